// Staging: each GGUF block format decoded to the kernels' one form (see quant.h). The loops are
// plain C++ over one block, written so the compiler vectorizes them in every ISA variant.
#include <cstring>
#include <vector>

#include "cpu/parallel.h"
#include "cpu/quant.h"
#include "cpu/vec_int8.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

// Nibbles plus a fifth bit from the 32-bit mask qh (bit i for value i).
inline void nibbles5(const uint8_t* qs, const uint8_t* qh_bytes, int8_t* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<int8_t>((qs[i] & 0x0F) | (((qh >> i) & 1u) << 4));
    q[i + 16] = static_cast<int8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1u) << 4));
  }
}

// The 32-value formats: one scale (and zero point) per block, so both 16-value halves share them.
void stage_q4_0(const uint8_t* b, int8_t* q, float* s, float* o) {
  s[0] = s[1] = half_to_float(b);
  o[0] = o[1] = -8.f * s[0];
  unpack_nibbles(b + 2, q);
}

void stage_q4_1(const uint8_t* b, int8_t* q, float* s, float* o) {
  s[0] = s[1] = half_to_float(b);
  o[0] = o[1] = half_to_float(b + 2);
  unpack_nibbles(b + 4, q);
}

void stage_q5_0(const uint8_t* b, int8_t* q, float* s, float* o) {
  s[0] = s[1] = half_to_float(b);
  o[0] = o[1] = -16.f * s[0];
  nibbles5(b + 6, b + 2, q);
}

void stage_q5_1(const uint8_t* b, int8_t* q, float* s, float* o) {
  s[0] = s[1] = half_to_float(b);
  o[0] = o[1] = half_to_float(b + 2);
  nibbles5(b + 8, b + 4, q);
}

void stage_q8_0(const uint8_t* b, int8_t* q, float* s, float* o) {
  s[0] = s[1] = half_to_float(b);
  o[0] = o[1] = 0.f;
  std::memcpy(q, b + 2, 32);
}

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* sc, int* scale, int* min) {
  if (j < 4) {
    *scale = sc[j] & 63;
    *min = sc[j + 4] & 63;
  } else {
    *scale = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
    *min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
  }
}

// Q4_K: d, dmin, 12 bytes of packed scales/mins, 128 bytes of nibbles; each 64 values are one
// 32-byte run whose low nibbles are sub-block 2i and high nibbles sub-block 2i + 1. Q5_K: the same,
// with 32 bytes qh before the nibbles whose bit j holds the fifth bit of sub-block j's value i.
template <bool FifthBit>
void stage_k(const uint8_t* b, int8_t* q, float* s, float* o) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (FifthBit ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min_k4(j, scales, &sc, &m);
    s[2 * j] = s[2 * j + 1] = d * static_cast<float>(sc);
    o[2 * j] = o[2 * j + 1] = -(dmin * static_cast<float>(m));
    const uint8_t* run = qs + 32 * (j / 2);
    const int shift = (j % 2) * 4;
    for (int i = 0; i < 32; ++i) {
      int v = (run[i] >> shift) & 0x0F;
      if constexpr (FifthBit) v |= ((qh[i] >> j) & 1) << 4;
      q[32 * j + i] = static_cast<int8_t>(v);
    }
  }
}

// Q6_K: ql[128] low nibbles, qh[64] two high bits each, int8 scales[16] (one per 16 values), d.
// Per 128 values h: value l + 32 g (l < 32, g < 4) takes nibble (g & 1 ? ql[l + 32] : ql[l]) >> (g >= 2 ? 4 : 0)
// and bits (qh[l] >> 2g) & 3.
void stage_q6_k(const uint8_t* b, int8_t* q, float* s, float* o) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  for (int i = 0; i < 16; ++i) {
    s[i] = d * static_cast<float>(scales[i]);
    o[i] = -32.f * s[i];  // exact: s has at most 18 significant bits, and so has s * (q - 32)
  }
  for (int h = 0; h < 2; ++h) {
    const uint8_t* l4 = ql + 64 * h;
    const uint8_t* h2 = qh + 32 * h;
    int8_t* out = q + 128 * h;
    for (int l = 0; l < 32; ++l) {
      out[l] = static_cast<int8_t>((l4[l] & 0x0F) | ((h2[l] & 3) << 4));
      out[l + 32] = static_cast<int8_t>((l4[l + 32] & 0x0F) | (((h2[l] >> 2) & 3) << 4));
      out[l + 64] = static_cast<int8_t>((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4));
      out[l + 96] = static_cast<int8_t>((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4));
    }
  }
}

// The block loop with the block decoder inlined (a call per 32 values costs as much as the decode).
template <void (*Fn)(const uint8_t*, int8_t*, float*, float*), int BlockElems, int BlockBytes>
void stage(const StageArgs& a) {
  const int64_t k = a.w.cols, blocks = k / BlockElems;
  thread_local std::vector<uint8_t> unpacked;  // a packed matrix's row, back in the row layout
  if (a.w.panels) unpacked.resize(a.w.row_bytes);
  for (int64_t r = 0; r < a.num_rows; ++r) {
    const uint8_t* row = a.w.data + (a.first_row + r) * a.w.row_bytes;
    if (a.w.panels) {
      unpack_panel_row(a.w, a.first_row + r, unpacked.data());
      row = unpacked.data();
    }
    int8_t* q = a.q + r * k;
    float* s = a.scale + r * (k / 16);
    float* o = a.offset + r * (k / 16);
    for (int64_t b = 0; b < blocks; ++b)
      Fn(row + b * BlockBytes, q + b * BlockElems, s + b * (BlockElems / 16), o + b * (BlockElems / 16));
  }
}

}  // namespace

void stage_rows(const StageArgs& a) {
  switch (a.w.format) {
    case QFormat::kQ4_0: return stage<stage_q4_0, 32, 18>(a);
    case QFormat::kQ4_1: return stage<stage_q4_1, 32, 20>(a);
    case QFormat::kQ5_0: return stage<stage_q5_0, 32, 22>(a);
    case QFormat::kQ5_1: return stage<stage_q5_1, 32, 24>(a);
    case QFormat::kQ8_0: return stage<stage_q8_0, 32, 34>(a);
    case QFormat::kQ4_K: return stage<stage_k<false>, 256, 144>(a);
    case QFormat::kQ5_K: return stage<stage_k<true>, 256, 176>(a);
    case QFormat::kQ6_K: return stage<stage_q6_k, 256, 210>(a);
  }
}

void dequantize_rows(const DequantizeArgs& a) {
  const int64_t k = a.w.cols;
  parallel_for(a.num_rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> q(k);
    std::vector<float> s(k / 16), o(k / 16);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row = a.row_ids != nullptr ? a.row_ids[r] : a.first_row + r;
      stage_rows({a.w, row, 1, q.data(), s.data(), o.data()});
      float* out = a.out + r * a.out_stride;
      for (int64_t i = 0; i < k; ++i) {
        const float scaled = s[i / 16] * static_cast<float>(q[i]);
        out[i] = scaled + o[i / 16];
      }
    }
  });
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
