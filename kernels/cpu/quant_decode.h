// Each GGUF format's decoding, written once: block j of a packed unit (see quant.h) to the staged
// form (q, and a scale and offset per span) over the lane primitives of quant_lanes.h. The decode
// GEMV (Int8Panel::stream), the panel stager (stage_block) and the row dequantizer (dequantize_rows) all decode
// through decode_block, in whichever lanes they read.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cpu/quant.h"
#include "cpu/quant_lanes.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

// f(std::integral_constant<QFormat, format>): kernels specialised per format, picked at run time.
template <class Fn>
void with_format(QFormat format, Fn&& f) {
  switch (format) {
    case QFormat::kQ4_0: return f(std::integral_constant<QFormat, QFormat::kQ4_0>{});
    case QFormat::kQ4_1: return f(std::integral_constant<QFormat, QFormat::kQ4_1>{});
    case QFormat::kQ5_0: return f(std::integral_constant<QFormat, QFormat::kQ5_0>{});
    case QFormat::kQ5_1: return f(std::integral_constant<QFormat, QFormat::kQ5_1>{});
    case QFormat::kQ8_0: return f(std::integral_constant<QFormat, QFormat::kQ8_0>{});
    case QFormat::kQ4_K: return f(std::integral_constant<QFormat, QFormat::kQ4_K>{});
    case QFormat::kQ5_K: return f(std::integral_constant<QFormat, QFormat::kQ5_K>{});
    case QFormat::kQ6_K: return f(std::integral_constant<QFormat, QFormat::kQ6_K>{});
  }
}

// f(std::integral_constant<int, J>{}) for J = 0, 1, ... in order: the blocks of a unit unrolled, so that
// a block's place in its unit (which bytes and bits hold its values and scales) is a constant and its
// shifts are immediates rather than the two-uop variable-count forms.
template <class Fn, int... J>
inline void each_block(Fn&& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}
// The same for the one block j given at run time.
template <class Fn, int... J>
inline void at_block(int j, Fn&& f, std::integer_sequence<int, J...>) {
  ((j == J ? f(std::integral_constant<int, J>{}) : void()), ...);
}

// Block j (0 <= j < packed_unit(F).blocks) of a packed unit whose runs and header fields start at
// `runs` and `headers` (offset to the lanes' first row): u[v] holds values 4v..4v+3 of the block,
// one row per lane (q unsigned, 0 <= q < 64, but Q8_0's signed bytes as they lie), and per span of
// 16 * S values (S = 2: s[0], o[0]; S = 1: s[0..1], o[0..1]) the rows' scale and offset, so that
// w = scale * q + offset as the gguf package dequantizes.
// Always inlined, as are the stagers below: called through one more level (Int8Panel::stage_block),
// GCC kept decode_block and stage_block out of line, and AVX-512 calls of 9 to 32 rows against Q4_K
// ran 10-20% slower (staging weighs most there).
template <class L, QFormat F, int j>
[[gnu::always_inline]] inline void decode_block(const uint8_t* runs, const uint8_t* headers, typename L::I* u, typename L::F* s,
                         typename L::F* o) {
  if constexpr (F == QFormat::kQ8_0) {
    for (int v = 0; v < 8; ++v) u[v] = L::run(runs, v);
    s[0] = L::halves(headers, 0);
    o[0] = L::set1(0.f);
  } else if constexpr (F == QFormat::kQ4_0 || F == QFormat::kQ4_1 || F == QFormat::kQ5_0 || F == QFormat::kQ5_1) {
    // Run v's low nibbles are values 4v..4v+3, its high nibbles 16 + 4v..; Q5's spread qh is run 0.
    constexpr bool kFifth = F == QFormat::kQ5_0 || F == QFormat::kQ5_1;
    constexpr int first = kFifth ? 1 : 0;
    for (int v = 0; v < 4; ++v) {
      const typename L::I w = L::run(runs, first + v);
      u[v] = L::nibbles(w, 0);
      u[v + 4] = L::nibbles(w, 4);
      if constexpr (kFifth) {
        u[v] = L::or_(u[v], L::bit_to(L::run(runs, 0), v, 4, 0x10));
        u[v + 4] = L::or_(u[v + 4], L::bit_to(L::run(runs, 0), v + 4, 4, 0x10));
      }
    }
    s[0] = L::halves(headers, 0);
    if constexpr (F == QFormat::kQ4_1 || F == QFormat::kQ5_1) o[0] = L::halves(headers, 1);
    else o[0] = L::mul(s[0], L::set1(F == QFormat::kQ4_0 ? -8.f : -16.f));
  } else if constexpr (F == QFormat::kQ4_K || F == QFormat::kQ5_K) {
    // Runs 0-2: the 12 bytes of 6-bit scales and mins (ggml's get_scale_min_k4); Q5_K's qh: runs
    // 3-10, bit j of its byte i the fifth bit of value i of block j; then the nibbles, 64 values a
    // 32-byte stretch, low nibbles block 2i and high nibbles block 2i + 1.
    const typename L::I w0 = L::run(runs, 0), w1 = L::run(runs, 1), w2 = L::run(runs, 2);
    typename L::I sc, m;
    if constexpr (j < 4) {
      sc = L::bits(w0, 8 * j, 6);
      m = L::bits(w1, 8 * j, 6);
    } else {
      sc = L::or_(L::bits(w2, 8 * (j - 4), 4), L::shl(L::bits(w0, 8 * (j - 4) + 6, 2), 4));
      m = L::or_(L::bits(w2, 8 * (j - 4) + 4, 4), L::shl(L::bits(w1, 8 * (j - 4) + 6, 2), 4));
    }
    s[0] = L::mul(L::halves(headers, 0), L::to_float(sc));
    o[0] = L::negate(L::mul(L::halves(headers, 1), L::to_float(m)));
    constexpr int first = F == QFormat::kQ5_K ? 11 : 3;
    for (int v = 0; v < 8; ++v) {
      u[v] = L::nibbles(L::run(runs, first + 8 * (j / 2) + v), 4 * (j % 2));
      if constexpr (F == QFormat::kQ5_K) u[v] = L::or_(u[v], L::bit_to(L::run(runs, 3 + v), j, 4, 0x10));
    }
  } else {
    static_assert(F == QFormat::kQ6_K);
    // Groups 0-31: ql, 32-47: qh, 48-51: the 16 int8 scales (where packed_run puts them); d the one
    // header field. Block j = 4h + g of value l takes nibble (g & 1 ? ql[l + 32] : ql[l]) >> (g >= 2
    // ? 4 : 0) of 128-value half h, and bits 2g, 2g + 1 of qh[l].
    constexpr int h = j / 4, g = j % 4;
    const auto group = [&](int t) __attribute__((always_inline)) { return L::run(runs, packed_run(F, t)); };
    for (int v = 0; v < 8; ++v)
      u[v] = L::or_(L::nibbles(group(16 * h + 8 * (g & 1) + v), 4 * (g >> 1)),
                    L::bit_to(group(32 + 8 * h + v), 2 * g, 4, 0x30));
    const typename L::I scales = group(48 + 2 * h + g / 2);
    for (int e = 0; e < 2; ++e) {
      s[e] = L::mul(L::halves(headers, 0), L::to_float(L::sbyte(scales, 2 * (g % 2) + e)));
      o[e] = L::mul(L::set1(-32.f), s[e]);  // exact: s has at most 18 significant bits
    }
  }
}

// How many of vpmaddubsw's int16 pair sums of q against an int8 activation plane (|a| <= 127) can
// be added in int16 before widening, exactly: 8 of them stay below 2^15 for q < 16, 4 for q < 32,
// 2 for q < 64; Q8_0's signed q, moved to |q| <= 128, allows no sum at all.
constexpr int int16_pair_sums(QFormat f) {
  switch (f) {
    case QFormat::kQ4_0: case QFormat::kQ4_1: case QFormat::kQ4_K: return 8;
    case QFormat::kQ5_0: case QFormat::kQ5_1: case QFormat::kQ5_K: return 4;
    case QFormat::kQ6_K: return 2;
    case QFormat::kQ8_0: return 1;
  }
  return 1;
}

// Where unit `unit` of a packed panel (blocks 32-value blocks a row) keeps its runs and header
// fields, offset to row row0.
struct UnitAt {
  const uint8_t* runs;
  const uint8_t* headers;
};
template <QFormat F>
inline UnitAt unit_at(const uint8_t* panel, int64_t blocks, int64_t unit, int row0) {
  constexpr PackedUnit kUnit = packed_unit(F);
  return {panel + unit * kUnit.run_bytes + 4 * row0,
          panel + blocks / kUnit.blocks * kUnit.run_bytes + unit * kUnit.header_bytes + 2 * row0};
}

// f(u, s, o) with block b of a packed panel decoded for rows row0..row0 + L::kRows - 1.
template <class L, QFormat F, class Fn>
inline void with_decoded_block(const uint8_t* panel, int64_t blocks, int64_t b, int row0, Fn&& f) {
  constexpr int kUnitBlocks = packed_unit(F).blocks;
  const UnitAt at = unit_at<F>(panel, blocks, b / kUnitBlocks, row0);
  at_block(static_cast<int>(b % kUnitBlocks), [&](auto j) {
    typename L::I u[8];
    typename L::F s[2], o[2];
    decode_block<L, F, decltype(j)::value>(at.runs, at.headers, u, s, o);
    f(u, s, o);
  }, std::make_integer_sequence<int, kUnitBlocks>{});
}

// The staged panel layout (vec_int8.h's StagedPanel): for 16-value group g, q holds four 64-byte
// vectors whose 4-byte lane r is values 4v..4v+3 of the group in row r (kPanelGroupValues values a
// group), scale and offset its 16 row values.
constexpr int kPanelRows = kPackRows;
constexpr int64_t kPanelGroupValues = 16 * kPanelRows;

// Block b of a packed panel staged, L::kRows rows at a time: its scales and offsets in that layout,
// and its values u (decode_block's, rows r0..r0 + L::kRows - 1) handed to store_values(u, r0).
template <class L, QFormat F, class StoreValues>
[[gnu::always_inline]] inline void stage_block_with(const uint8_t* panel, int64_t blocks, int64_t b, float* scale, float* offset,
                             StoreValues&& store_values) {
  constexpr int S = packed_unit(F).span_groups;
  for (int r0 = 0; r0 < kPanelRows; r0 += L::kRows)
    with_decoded_block<L, F>(panel, blocks, b, r0, [&](const auto* u, const auto* s, const auto* o) {
      store_values(u, r0);
      for (int g = 0; g < 2; ++g) {
        L::store(scale + (2 * b + g) * kPanelRows + r0, s[S == 2 ? 0 : g]);
        L::store(offset + (2 * b + g) * kPanelRows + r0, o[S == 2 ? 0 : g]);
      }
    });
}

// The same with the values as int8, in that layout.
template <class L, QFormat F>
[[gnu::always_inline]] inline void stage_block(const uint8_t* panel, int64_t blocks, int64_t b, int8_t* q, float* scale,
                                               float* offset) {
  stage_block_with<L, F>(panel, blocks, b, scale, offset, [&](const typename L::I* u, int r0) __attribute__((always_inline)) {
    for (int v = 0; v < 8; ++v) L::store(q + 2 * b * kPanelGroupValues + 64 * v + 4 * r0, u[v]);
  });
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
