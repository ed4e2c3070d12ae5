// Block-quantized weights (GGUF's formats, kept in their file layout) and the integer matmul over them.
//
// Every format is read through one intermediate form, the *staged row*: per weight row, k int8
// values q, one float scale and one float offset per 16 values, so that w[i] = scale[i / 16] * q[i] +
// offset[i / 16] exactly as the gguf package dequantizes. Every format but Q8_0 stages q unsigned (0
// to at most 63) with its zero point moved into the offset (Q4_0: q - 8 becomes q and -8 * scale):
// the unsigned-by-signed byte products (vpdpbusd, vpmaddubsw) then take q as it is, without the sign
// juggling that signed q costs per product. Only the decoding differs per format, written once
// (quant_decode.h) for every reader; the dot-product kernels see staged values alone.
//
// Activations are quantized per row in blocks of 32 to two int8 planes, x ~= d * (128 * hi + lo): hi
// as llama.cpp's Q8 activations (127 steps of the block's largest magnitude), lo the rounding error of
// hi in 1/128 steps. One plane alone moves the default model's top-1 token at ~3% of positions; two
// keep it at the float result's. A dot product then sums exact int32 products over each run of values
// that share a weight scale (scale_span) and accumulates those in float in a fixed order that depends
// only on k and the format: every path (one row or many, any tile, any thread count)
// reduces an output element the same way, so a row's result never depends on the rest of the batch.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cpu/types.h"

namespace mindie::kernels::cpu {

// ggml type ids. Dense F32 / F16 / BF16 matrices are not quantized formats (see linear.h).
enum class QFormat : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

struct QFormatInfo {
  int block_elems;  // values per block (32, or 256 for the K formats)
  int block_bytes;
  bool signed_q;    // staged q is signed and the offset zero (Q8_0); else 0 <= q < 64
  int scale_span;   // values sharing one scale and offset: 32, or 16 for Q6_K's sub-blocks
};

// Throws std::invalid_argument for a type id that is not one of QFormat. constexpr, so kernels
// specialised for one format read its block size at compile time.
constexpr QFormatInfo qformat_info(int ggml_type) {
  switch (static_cast<QFormat>(ggml_type)) {
    case QFormat::kQ4_0: return {32, 18, false, 32};
    case QFormat::kQ4_1: return {32, 20, false, 32};
    case QFormat::kQ5_0: return {32, 22, false, 32};
    case QFormat::kQ5_1: return {32, 24, false, 32};
    case QFormat::kQ8_0: return {32, 34, true, 32};
    case QFormat::kQ4_K: return {256, 144, false, 32};
    case QFormat::kQ5_K: return {256, 176, false, 32};
    case QFormat::kQ6_K: return {256, 210, false, 16};
  }
  throw std::invalid_argument("ggml type " + std::to_string(ggml_type) +
                              " is not a supported quantized format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
}

// A weight matrix [rows, cols] in `format`: row-major (row r starts at data + r * row_bytes), or,
// with `panels` set, packed in panels (below).
struct QMatrix {
  const uint8_t* data;
  int64_t rows, cols, row_bytes;
  QFormat format;
  bool panels = false;
};

// Panel packing (pack_panels), for every format: the decode kernels then read 16 rows as whole
// vectors, one row per lane, with no shuffles (the row layout costs three inserts per four rows,
// which bounds a GEMV well below the memory's rate). The rows are padded with zero rows to a
// multiple of kPackRows; panel p (rows 16p to 16p + 15) takes the 16 * row_bytes bytes at
// data + 16p * row_bytes, as its rows do in the row layout. A panel holds, per unit (a block; a
// super-block of 256 values for the K formats), first the unit's *runs*, then its *header fields*:
//  - a block's 2-byte fields (d, Q4_1's m, the K formats' d and dmin) are header fields, 32 bytes
//    each, whose 2-byte lane r is row r's field;
//  - every other byte of the block, in the block's order, is cut into 4-byte groups: group t is run
//    t, 64 bytes whose 4-byte lane r holds row r's group t.
// So each run is 16 rows' bytes as GGUF stores them (Q4: low nibbles values 0-15, high nibbles
// values 16-31 of the block), except Q5_0 / Q5_1's qh: its 32 bits are spread (spread_qh) so that a
// shift and a mask put each value's fifth bit under its nibble. The runs lie in the block's order,
// except Q6_K's (packed_run).
constexpr int kPackRows = 16;
// Where group t of a block's runs lies in its packed unit. Q6_K's lie in the order its decoding
// first reads them (quant_decode.h): the 4 runs of scales, then per 128-value half h the runs of
// ql(16h + v) and qh(32 + 8h + v) alternating for v < 8, then ql(16h + 8 + v). In GGUF's order a
// block's reads jump between ql, qh 2 KiB on and back, and the decode GEMV read Q6_K from memory
// slower than Q4_K: on a Zen 5 core at one row 60% of torch's read rate against 74% in this order
// (Q4_K 74%), at 2 threads 80% against 86% (Q4_K 95%).
constexpr int packed_run(QFormat f, int t) {
  if (f != QFormat::kQ6_K) return t;
  if (t >= 48) return t - 48;
  if (t >= 32) return 4 + 24 * ((t - 32) / 8) + 2 * ((t - 32) % 8) + 1;
  const int h = t / 16, r = t % 16;
  return r < 8 ? 4 + 24 * h + 2 * r : 4 + 24 * h + 16 + (r - 8);
}
// Per row and unit: the bytes of runs and of header fields.
constexpr int packed_header_bytes(QFormat f) {
  return f == QFormat::kQ4_1 || f == QFormat::kQ5_1 || f == QFormat::kQ4_K || f == QFormat::kQ5_K ? 4 : 2;
}
constexpr int packed_quant_bytes(QFormat f) {
  return qformat_info(static_cast<int>(f)).block_bytes - packed_header_bytes(f);
}
// A format's packed unit as the kernels walk it: its 32-value blocks, 16-value groups per scale
// (2, or 1 for Q6_K), and a panel's bytes of runs and of header fields per unit.
struct PackedUnit {
  int blocks, span_groups;
  int64_t run_bytes, header_bytes;
};
constexpr PackedUnit packed_unit(QFormat f) {
  const QFormatInfo info = qformat_info(static_cast<int>(f));
  return {info.block_elems / 32, info.scale_span / 16, kPackRows * packed_quant_bytes(f), kPackRows * packed_header_bytes(f)};
}
constexpr int64_t packed_rows(int64_t rows) { return (rows + kPackRows - 1) / kPackRows * kPackRows; }
// Q5_0 / Q5_1's qh as packed: byte i's bit v holds the fifth bit of value 4v + i and its bit v + 4
// that of value 16 + 4v + i (i, v < 4), as run v's byte i holds those values' nibbles.
constexpr uint32_t spread_qh(uint32_t qh) {
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i)
    for (int v = 0; v < 4; ++v) {
      out |= ((qh >> (4 * v + i)) & 1u) << (8 * i + v);
      out |= ((qh >> (16 + 4 * v + i)) & 1u) << (8 * i + v + 4);
    }
  return out;
}
// `src` (row layout) into out [packed_rows(rows), row_bytes].
void pack_panels(const QMatrix& src, uint8_t* out);

// out[r, i] = scale * q + offset of rows [first_row, first_row + num_rows), float32.
struct DequantizeArgs {
  QMatrix w;
  int64_t first_row;
  int64_t num_rows;
  float* out;
  int64_t out_stride;
  const int32_t* row_ids;  // optional: gather these rows (num_rows of them) instead of a range
};

// Per row of x [m, k] (float32, k a multiple of 32): q [m, 2, k] int8 (hi then lo) and d [m, k / 32],
// x ~= d * (128 * hi + lo) block by block (round to nearest even). With planes = 1, lo is all zeros:
// x ~= d * 128 * hi, hi rounding x to 127 steps of the block's largest magnitude (llama.cpp's Q8_0
// activations), about 8 bits where two planes keep about 15.
struct QuantizeActivationsArgs {
  const float* x;
  int64_t m, k, x_stride;
  int8_t* q;
  float* d;
  int planes = 2;
};

// Per row of x [m, k] (float32): out [m, k] bfloat16, rounded to nearest even (as torch rounds).
struct RoundToBf16Args {
  const float* x;
  int64_t m, k, x_stride;
  bf16_t* out;  // rows back to back
};

// out_j[m, rows_j] = x @ W_j^T (+ bias_j) for a few matrices that share one input: their rows are
// split over the threads as one range (a layer's q/k/v or gate/up in one call). The input comes as
// int8 planes (xq, xd: the integer path above) or, with xb set, as bfloat16: each weight row is
// then rounded to bfloat16 (scale * q + offset, as the dense bf16 path holds it) and every output
// element is a float32 sum of exact bf16 x bf16 products, pair by pair in k order (vdpbf16ps where
// the CPU has AVX512-BF16; any other variant computes the same sums in float, slowly).
struct QMatmulTarget {
  QMatrix w;
  const float* bias;  // [rows] or nullptr
  float* out;         // [m, rows] with row stride out_stride
  int64_t out_stride;
};
constexpr int kMaxQMatmulTargets = 4;
struct QMatmulArgs {
  QMatmulTarget targets[kMaxQMatmulTargets];
  int num_targets;
  const int8_t* xq;  // [m, 2, k]: hi and lo planes
  const float* xd;   // [m, k / 32]
  const bf16_t* xb;  // or [m, k] bfloat16 (then xq and xd are unused)
  int64_t m, k;
  const int32_t* out_rows;  // optional: activation row c goes to output row out_rows[c] (else c)
  // 1 where xq was quantized with planes = 1: its lo plane is zeros, and the kernels that take byte
  // products per plane skip it (the same exact int32 sums, so the same bits, for half the products).
  int planes = 2;
};

// Whether the active kernel variant computes bf16 activations with native bf16 dot products
// (AVX512-BF16), so that qmatmul's bf16 input is the fast choice rather than a slow emulation.
bool qmatmul_bf16_native();

void dequantize_rows(const DequantizeArgs& args);
void quantize_activations(const QuantizeActivationsArgs& args);
void round_to_bf16(const RoundToBf16Args& args);
void qmatmul(const QMatmulArgs& args);

// Several independent calls (each its own input rows and targets) in one: the same results as
// qmatmul on each. Calls of few int8 rows, all as many, against matrices packed in panels run as one
// walk over all their panels on the threads (the routed experts of a decode step: one dispatch
// instead of one per expert, and the prefetches run on from one matrix into the next); otherwise
// each call runs alone.
constexpr int kMaxQMatmulBatch = 16;
struct QMatmulBatchArgs {
  const QMatmulArgs* calls;
  int num_calls;
};
void qmatmul_batch(const QMatmulBatchArgs& args);

#define MINDIE_QUANT_KERNELS(X)                                                           \
  X(dequantize_rows, DequantizeArgs) X(quantize_activations, QuantizeActivationsArgs) \
  X(round_to_bf16, RoundToBf16Args) X(qmatmul, QMatmulArgs) X(qmatmul_batch, QMatmulBatchArgs)

}  // namespace mindie::kernels::cpu
