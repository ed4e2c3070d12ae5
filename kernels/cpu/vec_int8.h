// Int8 and bf16 dot products for the quantized matmul (quant_matmul.cpp), one struct per ISA
// variant: the only other file with intrinsics besides vec.h. Int8 activations come as two planes,
// x = d * (128 * hi + lo) (see quantize_block32), or as one, the lo plane zeros (QMatmulArgs::planes),
// which the kernels that take byte products per plane skip; bf16 activations as they are (Bf16Panel).
//
// The weights are read as *panels*: 16 rows side by side, so that a vector lane is an output row
// (see StagedPanel). Int8Panel::tile<..., S> computes, for each output element (weight row r,
// activation row c), over *spans* of 16 * S values that share one weight scale (S = 2 for formats
// whose scale covers 32 values, 1 for Q6_K's 16):
//   f = 0;  for each span j in order:
//     s = sum over the span of q * (128 * hi + lo)                         (exact int32)
//     f = fma(float(s), scale_j * d_c(j), f)
//     f = fma(offset_j, sum_c(j), f)        (unsigned q only; sum_c(j) = d * sum of 128 * hi + lo)
// one scalar chain per element in one lane, whatever the ISA's vector width, the tile shape or the
// thread split: an output element is reduced identically wherever it is computed. How s is summed
// is the path's own, since any order gives the same exact int32: the prompt tiles of AVX2 and
// AVX-512 (WidePanel) multiply int16, q against 128 * hi + lo (ActRef::wide) in one vpmaddwd or
// vpdpwssd; the decode GEMV (stream), AVX-512's byte tile (with VNNI, and without it for one plane:
// Int8Panel::one_plane_pairs), AVX2's byte tile for one plane (BytePanel) and the scalar tile take
// byte products of q against each plane (vpdpbusd or vpmaddubsw; unsigned q goes straight into the
// unsigned operand, signed q (Q8_0) goes in as |q| with its sign moved onto the activations).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/quant.h"
#include "cpu/quant_decode.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

// A staged panel: its values as the variant's tile multiplies them (Int8Panel::Weight), and a scale
// and offset per 16-value group and row. Int8 values lie in quant_decode.h's layout; int16 ones
// (Int8Panel::kWide) in the wide layout: for 16-value group g and pair p (values 2p and 2p + 1 of
// the group), 32 int16 at q + (8 * g + p) * 32 whose 4-byte lane r holds the pair of row r.
// Where, in a panel staged in the wide layout, the two pairs of vector v (values 4v..4v + 3 of
// 32-value block b, quant_decode.h's layout) start: the first pair there, the second 32 values on.
constexpr int64_t wide_pairs_at(int64_t b, int v) { return (8 * (2 * b + v / 4) + 2 * (v % 4)) * 32; }

template <class Q>
struct StagedPanel {
  const Q* q;
  const float* scale;
  const float* offset;
};
// A bf16 panel: the same 16 rows as bf16 weights scale * q + offset. For 16-value group j it holds
// eight 64-byte vectors whose 4-byte lane r is values 2p and 2p + 1 of the group in row r
// (kBf16PanelGroupElems bf16 values per group), the operand layout of vdpbf16ps.
constexpr int64_t kBf16PanelGroupElems = 16 * kPanelRows;

// One activation row: its two planes, d per 32 values and d * sum(128 * hi + lo) per 16 and per 32;
// for a variant whose tile multiplies int16 (Int8Panel::kWide), 128 * hi + lo itself (|value| <= 2^14).
struct ActRef {
  const int8_t* hi;
  const int8_t* lo;
  const int16_t* wide;
  const float* d;
  const float* sum16;
  const float* sum32;
  template <int S>
  float sum(int64_t span) const { return S == 2 ? sum32[span] : sum16[span]; }
};

// The C activation rows of a streaming GEMV call (Int8Panel::stream) laid out by block: block b's
// 32 values of row c in both planes at planes + (b * C + c) * 64 (hi, then lo), its d and sums at
// [b * C + c]. One pointer per field then reaches every row at a constant offset; through ActRef,
// 8 rows brought 32 pointers that outnumbered the general registers and were reloaded from the
// stack between the dot products.
struct StreamRows {
  const int8_t* planes;  // [blocks][C][hi 32, lo 32]
  const float* d;        // [blocks][C]
  const float* sum32;    // [blocks][C]
  const float* sum16;    // [2 * blocks][C]
};

// One block's share of the prefetches of the panel a streaming GEMV reads next: its `lines` cache
// lines from `at`, issued into L2 (prefetcht1) one at a time between the block's dot products
// (slot()) rather than as a burst of back-to-back prefetch instructions. On a Sapphire Rapids core
// the burst held a Q4_0 panel walk at 12.5 GB/s where a plain read makes 16; spaced two dot-product
// steps apart, the same prefetches run at the plain read's rate (the AVX2 kernel there: 10.0 to 14.0
// GB/s; prefetcht0 gave 12). A Zen 5 core at one activation row wants the opposite (burst(), where
// use_burst_prefetch() says so). The methods are always inlined: GCC 12 otherwise finds them free
// of side effects (it sees none in a prefetch) and drops the calls.
struct BlockPrefetch {
  // Where nothing is left to prefetch, slot() touches this line instead (an L1 hit).
  alignas(64) static inline const uint8_t kIdleLine[64] = {};
  const uint8_t* at;
  int64_t lines;
  int64_t last;  // offset of the last line slot() prefetches
  BlockPrefetch(const uint8_t* pf, const uint8_t* pf_end, int64_t pf_step)
      : at(pf < pf_end ? pf : kIdleLine),
        lines(pf < pf_end ? (std::min(pf_step, static_cast<int64_t>(pf_end - pf)) + 63) / 64 : 0),
        last(64 * (std::clamp<int64_t>(lines, 1, 8) - 1)) {}
  // Step s (0 to 15, a compile-time constant once unrolled) of the block's dot products. Without a
  // branch: a slot past the block's lines prefetches its last one again. Branches here, one per slot
  // and activation row, made a Zen 5 core take 2 and 4 rows from L2 about twice as long.
  [[gnu::always_inline]] void slot(int s) const {
    if (s % 2 == 0) __builtin_prefetch(at + std::min<int64_t>(32 * s, last), 0, 2);
  }
  // Slot v of the dot products against `plane` of P planes: where the lo plane is skipped (P = 1),
  // its slots come beside the hi plane's.
  template <int P>
  [[gnu::always_inline]] void plane_slot(int plane, int v) const {
    slot(8 * plane + v);
    if constexpr (P == 1) slot(8 + v);
  }
  // The lines slot() leaves (more than 8 a block: Q8_0).
  [[gnu::always_inline]] void rest() const {
    for (int64_t l = 8; l < lines; ++l) __builtin_prefetch(at + 64 * l, 0, 2);
  }
  // All of the block's lines at once into L1 (prefetcht0), in place of slot() and rest(): the AVX-512
  // stream at one row where use_burst_prefetch() (Int8Panel::stream).
  [[gnu::always_inline]] void burst() const {
    for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(at + 64 * l, 0, 3);
  }
};

// A tile over panels staged as int8 in quant_decode.h's layout (the byte tiles): its weight type and stager.
struct ByteStaging {
  using Weight = int8_t;
  static constexpr bool kWide = false;
  template <QFormat F>
  static void stage_block(const uint8_t* panel, int64_t blocks, int64_t b, int8_t* q, float* scale, float* offset) {
    MINDIE_ISA_NS::stage_block<Lanes, F>(panel, blocks, b, q, scale, offset);
  }
};

#if defined(MINDIE_ISA_AVX512)

// AVX-512: a panel's 16 rows are one vector's 16 int32 lanes. Vnni: vpdpbusd, else
// vpmaddubsw + vpmaddwd (the same exact int32 sums either way). The byte tile here is the VNNI
// prompt path of unsigned formats and of one-plane rows, and without VNNI that of one-plane rows;
// WidePanel (below) takes the rest.
template <bool Vnni>
struct Int8Panel : ByteStaging {
  // Panels x activation rows per register tile: 3 x 4 int32 and float accumulators, three weight
  // vectors and a broadcast fit the 32 vector registers (5-10% faster than 2 x 4 or 2 x 6 at 32
  // and 512 rows; 1 x 8 runs at less than half the speed). GCC keeps the float ones on the stack even
  // so, yet tiles of more int32 accumulators ran slower: a 3B decode step's projections at 32 rows
  // took 527-548 ms as 3 x 8 or 4 x 6 against 313-321 (4 x 4: 321-329). Without VNNI 2 x 4:
  // one_plane_pairs's int16 sums take as many registers again as the int32 ones.
  static constexpr int kTilePanels = Vnni ? 3 : 2;
  static constexpr int kTileCols = 4;
  static constexpr bool kOnePlaneOnly = false;

  static __m512i dot(__m512i acc, __m512i u, __m512i s) {
    if constexpr (Vnni) return _mm512_dpbusd_epi32(acc, u, s);
    else return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
  }
  static __m512i broadcast4(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  // out[(r * C + c) * 16 + lane] = f of panel r's row `lane` and activation row c, for panels of
  // format F. P: the planes of x to take (1 where the lo plane is zeros).
  template <int R, int C, QFormat F, int P>
  static void tile(const StagedPanel<int8_t>* w, const ActRef* x, int64_t groups, float* out) {
    constexpr QFormatInfo info = qformat_info(static_cast<int>(F));
    constexpr bool Signed = info.signed_q;
    constexpr int S = info.scale_span / 16;
    __m512 f[R][C];
    clear(f);
    for (int64_t j = 0; j < groups; j += S) {
      __m512i acc[R][C];
      clear(acc);
      if constexpr (!Vnni && P == 1) {
        one_plane_pairs<R, C, F>(w, x, j, acc);
      } else {
        for (int plane = 0; plane < P; ++plane) {
          if (plane == 1)
            for (int r = 0; r < R; ++r)
              for (int c = 0; c < C; ++c) acc[r][c] = _mm512_slli_epi32(acc[r][c], 7);
          for (int v = 0; v < 4 * S; ++v) {
            __m512i wq[R];
            __mmask64 neg[R];
            for (int r = 0; r < R; ++r) {
              wq[r] = _mm512_loadu_si512(w[r].q + j * kPanelGroupValues + v * 64);
              if constexpr (Signed) {
                neg[r] = _mm512_movepi8_mask(wq[r]);
                wq[r] = _mm512_abs_epi8(wq[r]);
              }
            }
            for (int c = 0; c < C; ++c) {
              const __m512i b = broadcast4((plane == 0 ? x[c].hi : x[c].lo) + 16 * j + 4 * v);
              for (int r = 0; r < R; ++r) {
                if constexpr (Signed) acc[r][c] = dot(acc[r][c], wq[r], _mm512_mask_sub_epi8(b, neg[r], _mm512_setzero_si512(), b));
                else acc[r][c] = dot(acc[r][c], wq[r], b);
              }
            }
          }
        }
        if constexpr (P == 1)
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_slli_epi32(acc[r][c], 7);
      }
      add_span<R, C, Signed, S>(w, x, j, acc, f);
    }
    store(f, out);
  }
  // acc = span j's sums of 128 * hi (one plane) without VNNI: vpmaddubsw with the pairs summed in
  // int16 as far as q's range allows (int16_pair_sums), then one vpmaddwd by 128 widens them, where
  // dot() widens every product (as AVX2's BytePanel).
  template <int R, int C, QFormat F>
  [[gnu::always_inline]] static void one_plane_pairs(const StagedPanel<int8_t>* w, const ActRef* x, int64_t j,
                                                     __m512i (&acc)[R][C]) {
    constexpr QFormatInfo info = qformat_info(static_cast<int>(F));
    constexpr int kSteps = info.scale_span / 4, kPairs = std::min(int16_pair_sums(F), kSteps);
    for (int v0 = 0; v0 < kSteps; v0 += kPairs) {
      __m512i pairs[R][C];
      clear(pairs);
      for (int v = v0; v < v0 + kPairs; ++v) {
        __m512i wq[R];
        __mmask64 neg[R];
        for (int r = 0; r < R; ++r) {
          wq[r] = _mm512_loadu_si512(w[r].q + j * kPanelGroupValues + v * 64);
          if constexpr (info.signed_q) {
            neg[r] = _mm512_movepi8_mask(wq[r]);
            wq[r] = _mm512_abs_epi8(wq[r]);
          }
        }
        for (int c = 0; c < C; ++c) {
          const __m512i b = broadcast4(x[c].hi + 16 * j + 4 * v);
          for (int r = 0; r < R; ++r) {
            const __m512i s = info.signed_q ? _mm512_mask_sub_epi8(b, neg[r], _mm512_setzero_si512(), b) : b;
            pairs[r][c] = _mm512_add_epi16(pairs[r][c], _mm512_maddubs_epi16(wq[r], s));
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_add_epi32(acc[r][c], _mm512_madd_epi16(pairs[r][c], _mm512_set1_epi16(128)));
    }
  }

  // f += span j's exact sums acc, scaled: the float chain every path runs (see the top of the file).
  template <int R, int C, bool Signed, int S, class Q>
  static void add_span(const StagedPanel<Q>* w, const ActRef* x, int64_t j, const __m512i (&acc)[R][C], __m512 (&f)[R][C]) {
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_loadu_ps(w[r].scale + 16 * j), offset = _mm512_loadu_ps(w[r].offset + 16 * j);
      for (int c = 0; c < C; ++c) {
        f[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_mul_ps(scale, _mm512_set1_ps(x[c].d[j / 2])), f[r][c]);
        if constexpr (!Signed) f[r][c] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x[c].template sum<S>(j / S)), f[r][c]);
      }
    }
  }
  // Every vector of a register tile set to zero.
  template <class V, int R, int C>
  static void clear(V (&v)[R][C]) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) v[r][c] = V{};
  }
  // out[(r * C + c) * 16 + lane] = f[r][c]'s lane.
  template <int R, int C>
  static void store(const __m512 (&f)[R][C], float* out) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (r * C + c) * 16, f[r][c]);
  }


  // Few activation rows (decode): a packed panel (see quant.h) read as it lies. Vector u[v] holds
  // values 4v..4v+3 of a block's 16 rows, one row per lane (decode_block), and meets 4 activation
  // values broadcast to every lane, as tile() meets a staged panel: the span sums are tile()'s exact
  // int32 values and the float chain is tile()'s, so a row gets the same bits whichever of the two
  // computes it.
  static constexpr int kStreamCols = 8;

  // out[c * 16 + r] = f of panel row r and activation row c, over P planes of x (as tile()).
  // Prefetches [pf, pf_end) meanwhile, pf_step bytes per block: spread into L2 (BlockPrefetch::slot),
  // or with Burst (one row) each block's share at once into L1, after its dot products
  // (BlockPrefetch::burst).
  template <QFormat F, int C, int P, bool Burst = false>
  static void stream(const uint8_t* panel, int64_t blocks, const StreamRows& x, const uint8_t* pf, const uint8_t* pf_end,
                     int64_t pf_step, float* out) {
    static_assert(!Burst || C == 1, "the burst is measured at one row only");
    constexpr int kUnitBlocks = packed_unit(F).blocks, S = packed_unit(F).span_groups;
    const __m512i z = _mm512_setzero_si512();
    __m512 f[C];
    for (int c = 0; c < C; ++c) f[c] = _mm512_setzero_ps();
    for (int64_t unit = 0; unit < blocks / kUnitBlocks; ++unit) {
      each_block([&](auto j) {
        const int64_t b = unit * kUnitBlocks + decltype(j)::value;
        // Spread, into L2 (prefetcht1), not L1: panels ahead do not fit beside the one being read, and
        // the L1 fill buffers stay free for the demand loads (9-15% more GB/s from memory than
        // prefetcht0). A Zen 5 core at one row read faster still with the burst into L1 (Burst).
        const BlockPrefetch ahead(pf, pf_end, pf_step);
        pf += pf_step;
        const UnitAt at = unit_at<F>(panel, blocks, unit, 0);
        __m512i u[8];
        __m512 sc[2], off[2];
        decode_block<Lanes, F, decltype(j)::value>(at.runs, at.headers, u, sc, off);
        __m512i wq[8];
        __mmask64 neg[8];
        for (int v = 0; v < 8; ++v) {
          wq[v] = u[v];
          // Signed values (Q8_0): as |q| against activations carrying q's sign (exact, as tile() does).
          if constexpr (F == QFormat::kQ8_0) {
            neg[v] = _mm512_movepi8_mask(u[v]);
            wq[v] = _mm512_abs_epi8(u[v]);
          }
        }
        auto row = [&](int c) __attribute__((always_inline)) {
          // Two chains per plane (S = 2) or one per span (S = 1): the int32 sums are exact, so their
          // order does not matter.
          __m512i acc[2][2] = {{z, z}, {z, z}};
          for (int plane = 0; plane < P; ++plane) {
            const int8_t* a = x.planes + (b * C + c) * 64 + 32 * plane;
            for (int v = 0; v < 8; ++v) {
              if (!Burst && c == 0) ahead.plane_slot<P>(plane, v);
              const int chain = S == 2 ? v % 2 : v / 4;
              const __m512i sv = broadcast4(a + 4 * v);
              if constexpr (F == QFormat::kQ8_0) acc[plane][chain] = dot(acc[plane][chain], wq[v], _mm512_mask_sub_epi8(sv, neg[v], z, sv));
              else acc[plane][chain] = dot(acc[plane][chain], wq[v], sv);
            }
          }
          const __m512 xd = _mm512_set1_ps(x.d[b * C + c]);
          if constexpr (S == 2) {
            const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(acc[0][0], acc[0][1]), 7),
                                                 _mm512_add_epi32(acc[1][0], acc[1][1]));
            f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sc[0], xd), f[c]);
            if constexpr (F != QFormat::kQ8_0) f[c] = _mm512_fmadd_ps(off[0], _mm512_set1_ps(x.sum32[b * C + c]), f[c]);
          } else {
            for (int e = 0; e < 2; ++e) {
              const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(acc[0][e], 7), acc[1][e]);
              f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sc[e], xd), f[c]);
              f[c] = _mm512_fmadd_ps(off[e], _mm512_set1_ps(x.sum16[(2 * b + e) * C + c]), f[c]);
            }
          }
        };
        // Unrolled, each row's float accumulator stays in a register instead of going through the
        // stack every block: from L2 on a Zen 5 core, Q4_K 2 and 4 rows 17.6 -> 12.9 and 26.2 -> 21.7
        // us, Q4_0 8 rows 49 -> 36. At 7 and 8 rows of Q4_K and Q6_K, whose blocks decode with more
        // live values, unrolled rows spill: Q6_K at 7 rows 43-45 -> 57-59 us.
        if constexpr ((F == QFormat::kQ6_K || F == QFormat::kQ4_K) && C >= 7) {
          for (int c = 0; c < C; ++c) row(c);
        } else {
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) row(c);
        }
        if constexpr (Burst) ahead.burst();
        else ahead.rest();
      }, std::make_integer_sequence<int, kUnitBlocks>{});
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + c * 16, f[c]);
  }
};

// The int16 prompt tile over staged panels in the wide layout, with Int8Panel's decode GEMV. Where
// VNNI runs formats of unsigned q, Int8Panel's byte tile stays (quant_matmul.cpp's qmatmul): it
// stages half the bytes, and at 9 to 64 rows (decode batches) it ran 6-11% faster than this one for
// Q4_0 and 2-8% for Q6_K on a Sapphire Rapids (2048 x 8192, 2 threads), Q4_K even.
template <bool Vnni>
struct WidePanel : Int8Panel<Vnni> {
  using Int8Panel<Vnni>::broadcast4;
  using Int8Panel<Vnni>::clear;
  // The prompt tile multiplies int16, as the AVX2 one: q (staged in the wide layout) against
  // 128 * hi + lo in one vpdpwssd (VNNI) or vpmaddwd + vpaddd, where the two byte planes took two
  // vpdpbusd, or two vpmaddubsw + vpmaddwd + vpaddd, plus the sign moves of Q8_0. 2 panels x 6 rows:
  // 12 int32 and 12 float accumulators. On a Sapphire Rapids core, 2048 x 96 tiles, G multiply-adds
  // a second from the byte planes (3 x 4 tiles) to int16: Q4 146-164 -> 164 (VNNI) and 66 -> 106
  // (without), Q6_K 119-131 -> 144 and 59 -> 97, Q8_0 65 -> 173 and 42 -> 103; int16 in 3 x 4 tiles
  // ran at 140 (VNNI) and 100 (without).
  static constexpr int kTilePanels = 2;
  static constexpr int kTileCols = 6;
  using Weight = int16_t;
  static constexpr bool kWide = true;

  // Block b of a packed panel staged in the wide layout (see StagedPanel).
  template <QFormat F>
  static void stage_block(const uint8_t* panel, int64_t blocks, int64_t b, int16_t* q, float* scale, float* offset) {
    const __m512i first = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(1));
    stage_block_with<Lanes, F>(panel, blocks, b, scale, offset, [&](const __m512i* u, int) __attribute__((always_inline)) {
      for (int v = 0; v < 8; ++v) {
        // Rows 0-7 and 8-15 widened (Q8_0's signed bytes or values below 64: sign-extended either
        // way), then each row's first and second pair gathered into one vector each.
        const __m512i lo = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(u[v]));
        const __m512i hi = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(u[v], 1));
        int16_t* dst = q + wide_pairs_at(b, v);
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi32(lo, first, hi));
        _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi32(lo, second, hi));
      }
    });
  }
  // k values of an activation row as 128 * hi + lo (ActRef::wide).
  static void widen(const int8_t* hi, const int8_t* lo, int64_t k, int16_t* out) {
    for (int64_t i = 0; i < k; i += 32) {
      const __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + i)));
      const __m512i l = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i)));
      _mm512_storeu_si512(out + i, _mm512_add_epi16(_mm512_slli_epi16(h, 7), l));
    }
  }

  // out[(r * C + c) * 16 + lane] = f of panel r's row `lane` and activation row c.
  template <int R, int C, bool Signed, int S>
  static void tile(const StagedPanel<int16_t>* w, const ActRef* x, int64_t groups, float* out) {
    __m512 f[R][C];
    clear(f);
    for (int64_t j = 0; j < groups; j += S) {
      __m512i acc[R][C];
      clear(acc);
#pragma GCC unroll 16
      for (int p = 0; p < 8 * S; ++p) {
        __m512i wq[R];
        for (int r = 0; r < R; ++r) wq[r] = _mm512_loadu_si512(w[r].q + (8 * j + p) * 32);
        for (int c = 0; c < C; ++c) {
          const __m512i b = broadcast4(x[c].wide + 16 * j + 2 * p);
          for (int r = 0; r < R; ++r) {
            if constexpr (Vnni) acc[r][c] = _mm512_dpwssd_epi32(acc[r][c], wq[r], b);
            else acc[r][c] = _mm512_add_epi32(acc[r][c], _mm512_madd_epi16(wq[r], b));
          }
        }
        // Pins the running sums once a pair: GCC otherwise reassociates the exact int32 adds into
        // one tree per span, every product first and spilled (103 -> 65 G/s without VNNI).
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) asm("" : "+v"(acc[r][c]));
      }
      Int8Panel<Vnni>::template add_span<R, C, Signed, S>(w, x, j, acc, f);
    }
    Int8Panel<Vnni>::store(f, out);
  }
};

// sum of 128 * hi[i] + lo[i] over 16 values, exactly (|sum| < 2^19).
inline int32_t plane_sum16(const int8_t* hi, const int8_t* lo) {
  const __m512i h = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)));
  const __m512i l = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l));
}

// One block of 32 floats as x ~= d * (128 * hi + lo): hi rounds x to 127 steps of its largest
// magnitude, lo rounds what hi leaves to 1/128 of a step (about 15 bits in all). Returns d.
inline float quantize_block32(const float* x, int8_t* hi, int8_t* lo) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f, step = amax / 127.f;
  const __m512 iv = _mm512_set1_ps(inv), iv_lo = _mm512_set1_ps(inv * 128.f), sv = _mm512_set1_ps(step);
  for (int h = 0; h < 2; ++h) {
    const __m512 v = h == 0 ? a : b;
    const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(v, iv));
    const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qh), sv, v);
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(rest, iv_lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16 * h), _mm512_cvtsepi32_epi8(qh));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16 * h), _mm512_cvtsepi32_epi8(ql));
  }
  return step / 128.f;
}

#elif defined(MINDIE_ISA_AVX2)

#if defined(MINDIE_AVX_VNNI)
constexpr bool kAvxVnniBuilt = true;
#else
constexpr bool kAvxVnniBuilt = false;
#endif

// AVX2: a panel's 16 rows are two vectors of 8 int32 lanes (rows 0-7, 8-15). Vnni: AVX-VNNI's
// vpdpwssd and vpdpbusd on these vectors (use_avx_vnni), else vpmaddwd + vpaddd and vpmaddubsw +
// vpmaddwd + vpaddd: the same exact int32 sums either way. The VNNI instructions are inline asm
// (see MINDIE_AVX_VNNI in CMakeLists.txt).
template <bool Vnni>
struct Int8Panel {
  static_assert(!Vnni || kAvxVnniBuilt, "AVX-VNNI needs an assembler that knows it (MINDIE_AVX_VNNI)");
  // The prompt tile multiplies int16: q against 128 * hi + lo in one vpmaddwd, where the two byte
  // planes took two vpmaddubsw and the int16 sums between them (Q8_0's |q| up to 128 allowing none).
  // One panel x 4 activation rows (8 int32 accumulators; the float ones spill once a span). On a
  // Sapphire Rapids core, 2048 x 96 tiles: 56 -> 76 G multiply-adds/s (Q4), 55 -> 67 (Q6_K), 32 -> 77
  // (Q8_0); 4 rows beat 3 by 6-19% at k = 8192 (the panel from L2 rather than L1). With VNNI, 6 rows
  // (12 accumulators, two weight vectors and a broadcast: 15 of the 16 registers): each vpdpwssd
  // waits 5 cycles for the last one into its accumulator, so 8 accumulators allow at most 1.6 of its
  // two a cycle; Q4_0 calls of 64 to 256 rows ran 5-7% faster than with 4 rows, Q6_K and Q8_0 even.
  static constexpr int kTilePanels = 1;
  static constexpr int kTileCols = Vnni ? 6 : 4;
  using Weight = int16_t;
  static constexpr bool kWide = true;

  // acc plus the sums of 4 byte products, unsigned u by signed s.
  static __m256i dot(__m256i acc, __m256i u, __m256i s) {
    if constexpr (Vnni) {
#if defined(MINDIE_AVX_VNNI)
      asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
#endif
      return acc;
    } else {
      return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
    }
  }
  // acc plus the sums of 2 int16 products, w by b.
  static __m256i dot_pairs(__m256i acc, __m256i w, __m256i b) {
    if constexpr (Vnni) {
#if defined(MINDIE_AVX_VNNI)
      asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(b));
#endif
    } else {
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, b));
      // Pins the running sum: GCC otherwise reassociates the exact int32 adds into one tree per
      // span, computing every product first and spilling them (76 -> 48 G/s).
      asm("" : "+x"(acc));
    }
    return acc;
  }
  static __m256i broadcast4(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }

  // Block b of a packed panel staged in the wide layout (see StagedPanel).
  template <QFormat F>
  static void stage_block(const uint8_t* panel, int64_t blocks, int64_t b, int16_t* q, float* scale, float* offset) {
    const __m256i pairs_apart = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    stage_block_with<Lanes, F>(panel, blocks, b, scale, offset, [&](const __m256i* u, int r0) __attribute__((always_inline)) {
      for (int v = 0; v < 8; ++v) {
        // Rows 0-3 and 4-7 widened (bytes are Q8_0's signed values or values below 64: sign-extended
        // either way), then each row's two pairs sent to the two output vectors.
        const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(u[v])), pairs_apart);
        const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(u[v], 1)), pairs_apart);
        int16_t* dst = q + wide_pairs_at(b, v) + 2 * r0;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
      }
    });
  }
  // k values of an activation row as 128 * hi + lo (ActRef::wide).
  static void widen(const int8_t* hi, const int8_t* lo, int64_t k, int16_t* out) {
    for (int64_t i = 0; i < k; i += 16) {
      const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + i)));
      const __m256i l = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_add_epi16(_mm256_slli_epi16(h, 7), l));
    }
  }

  template <int R, int C, bool Signed, int S>
  static void tile(const StagedPanel<int16_t>* w, const ActRef* x, int64_t groups, float* out) {
    __m256 f[R][C][2];
    clear(f);
    for (int64_t j = 0; j < groups; j += S) {
      __m256i acc[R][C][2];
      clear(acc);
#pragma GCC unroll 16
      for (int p = 0; p < 8 * S; ++p) {
        __m256i wq[R][2];
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h)
            wq[r][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r].q + (8 * j + p) * 32 + 16 * h));
        for (int c = 0; c < C; ++c) {
          const __m256i b = broadcast4(x[c].wide + 16 * j + 2 * p);
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h) {
              acc[r][c][h] = dot_pairs(acc[r][c][h], wq[r][h], b);
            }
        }
      }
      add_span<R, C, Signed, S>(w, x, j, acc, f);
    }
    store(f, out);
  }

  // f += span j's exact sums acc, scaled: the float chain every path runs (see the top of the file).
  // Always inlined: called from the byte tile, GCC kept it out of line and the tile's sums went
  // through memory.
  template <int R, int C, bool Signed, int S, class Q>
  [[gnu::always_inline]] static void add_span(const StagedPanel<Q>* w, const ActRef* x, int64_t j,
                                              const __m256i (&acc)[R][C][2], __m256 (&f)[R][C][2]) {
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_loadu_ps(w[r].scale + 16 * j + 8 * h), offset = _mm256_loadu_ps(w[r].offset + 16 * j + 8 * h);
        for (int c = 0; c < C; ++c) {
          f[r][c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c][h]), _mm256_mul_ps(scale, _mm256_set1_ps(x[c].d[j / 2])), f[r][c][h]);
          if constexpr (!Signed) f[r][c][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x[c].template sum<S>(j / S)), f[r][c][h]);
        }
      }
  }
  // Every vector of a register tile (both halves of each panel) set to zero.
  template <class V, int R, int C>
  static void clear(V (&v)[R][C][2]) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) v[r][c][0] = v[r][c][1] = V{};
  }
  // out[(r * C + c) * 16 + 8 * h + lane] = f[r][c][h]'s lane.
  template <int R, int C>
  static void store(const __m256 (&f)[R][C][2], float* out) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + (r * C + c) * 16 + 8 * h, f[r][c][h]);
  }

  // Few activation rows, a packed panel read as it lies: see the AVX-512 variant. Rows 8h to
  // 8h + 7 are the 32 bytes at 32h of each 64-byte run and the 8 halves at 16h of each header field.
  static constexpr int kStreamCols = 8;

  template <QFormat F, int C, int P>
  static void stream(const uint8_t* panel, int64_t blocks, const StreamRows& x, const uint8_t* pf, const uint8_t* pf_end,
                     int64_t pf_step, float* out) {
    constexpr int kUnitBlocks = packed_unit(F).blocks, S = packed_unit(F).span_groups;
    constexpr int kPairSums = int16_pair_sums(F);  // byte products summed in int16 before widening
    const __m256i z = _mm256_setzero_si256();
    __m256 f[C][2];
    for (int c = 0; c < C; ++c) f[c][0] = f[c][1] = _mm256_setzero_ps();
    for (int64_t unit = 0; unit < blocks / kUnitBlocks; ++unit) {
      each_block([&](auto j) {
        const int64_t b = unit * kUnitBlocks + decltype(j)::value;
        const BlockPrefetch ahead(pf, pf_end, pf_step);
        pf += pf_step;
        for (int h = 0; h < 2; ++h) {
          const UnitAt at = unit_at<F>(panel, blocks, unit, 8 * h);
          __m256i u[8];
          __m256 sc[2], off[2];
          decode_block<Lanes, F, decltype(j)::value>(at.runs, at.headers, u, sc, off);
          auto row = [&](int c) __attribute__((always_inline)) {
            if constexpr (F == QFormat::kQ8_0) {
              // |q| may be 128: each product pair is widened on its own (dot), as tile() does.
              __m256i acc[2] = {z, z};
              for (int plane = 0; plane < P; ++plane) {
                const int8_t* a = x.planes + (b * C + c) * 64 + 32 * plane;
                for (int v = 0; v < 8; ++v) {
                  if (h == 0 && c == 0) ahead.plane_slot<P>(plane, v);
                  acc[plane] = dot(acc[plane], _mm256_abs_epi8(u[v]), _mm256_sign_epi8(broadcast4(a + 4 * v), u[v]));
                }
              }
              const __m256i sum = _mm256_add_epi32(_mm256_slli_epi32(acc[0], 7), acc[1]);
              f[c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(sc[0], _mm256_set1_ps(x.d[b * C + c])), f[c][h]);
            } else {
              __m256i sum[2] = {z, z};  // per span (S = 1), or sum[0] alone
              if constexpr (Vnni) {
                // acc[plane][e]: span e's sums (S = 1), or those of the block's even and odd quads
                // (S = 2: two chains of vpdpbusd's latency rather than one of 8).
                __m256i acc[2][2] = {{z, z}, {z, z}};
                for (int plane = 0; plane < P; ++plane) {
                  const int8_t* a = x.planes + (b * C + c) * 64 + 32 * plane;
                  for (int v = 0; v < 8; ++v) {
                    if (h == 0 && c == 0) ahead.plane_slot<P>(plane, v);
                    __m256i& s = acc[plane][S == 2 ? v % 2 : v / 4];
                    s = dot(s, u[v], broadcast4(a + 4 * v));
                  }
                }
                if constexpr (S == 2) {
                  acc[0][0] = _mm256_add_epi32(acc[0][0], acc[0][1]);
                  acc[1][0] = _mm256_add_epi32(acc[1][0], acc[1][1]);
                }
                for (int e = 0; e < 3 - S; ++e) sum[e] = _mm256_add_epi32(_mm256_slli_epi32(acc[0][e], 7), acc[1][e]);
              } else {
                for (int plane = 0; plane < P; ++plane) {
                  const int8_t* a = x.planes + (b * C + c) * 64 + 32 * plane;
                  for (int v0 = 0; v0 < 8; v0 += kPairSums) {
                    __m256i pairs = z;
                    for (int v = v0; v < v0 + kPairSums; ++v) {
                      if (h == 0 && c == 0) ahead.plane_slot<P>(plane, v);
                      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[v], broadcast4(a + 4 * v)));
                    }
                    const int span = S == 2 ? 0 : v0 / 4;
                    sum[span] = _mm256_add_epi32(sum[span], _mm256_madd_epi16(pairs, _mm256_set1_epi16(plane == 0 ? 128 : 1)));
                  }
                }
              }
              const __m256 xd = _mm256_set1_ps(x.d[b * C + c]);
              for (int e = 0; e < 3 - S; ++e) {
                f[c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[e]), _mm256_mul_ps(sc[e], xd), f[c][h]);
                f[c][h] = _mm256_fmadd_ps(off[e], _mm256_set1_ps(S == 2 ? x.sum32[b * C + c] : x.sum16[(2 * b + e) * C + c]), f[c][h]);
              }
            }
          };
          // Unrolled as in the AVX-512 variant, but only up to 2 rows: with 16 registers, 3 rows of
          // Q6_K and 4 of Q4_K spill and run up to twice as long. On a Zen 5 core from L2, 2 rows:
          // Q4_K 38.3 -> 32.2 us, Q6_K 48.5 -> 39.6, Q8_0 33.8 -> 31.1.
          if constexpr (C <= 2) {
#pragma GCC unroll 2
            for (int c = 0; c < C; ++c) row(c);
          } else {
            for (int c = 0; c < C; ++c) row(c);
          }
        }
        ahead.rest();
      }, std::make_integer_sequence<int, kUnitBlocks>{});
    }
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + c * 16 + 8 * h, f[c][h]);
  }
};

// The byte tile for rows of one plane (quant_matmul.cpp's qmatmul routes only those here): a byte
// product per weight where the int16 tile takes one per value of 128 * hi + lo, over staged panels
// in quant_decode.h's byte layout (rows 8h to 8h + 7 the 32 bytes at 32h of each 64-byte vector).
// With AVX-VNNI vpdpbusd; without, vpmaddubsw with the pairs summed in int16 as far as q's range
// allows (int16_pair_sums), then one vpmaddwd by 128 widens them (and gives the sum of 128 * hi).
// Signed q (Q8_0) goes in as |q| with its sign moved onto the activations, as in the stream.
template <bool Vnni>
struct BytePanel : Int8Panel<Vnni>, ByteStaging {
  using Int8Panel<Vnni>::broadcast4;
  using Int8Panel<Vnni>::dot;
  using Int8Panel<Vnni>::clear;
  using Int8Panel<Vnni>::store;
  using ByteStaging::Weight;
  using ByteStaging::kWide;
  using ByteStaging::stage_block;
  // 1 panel x 6 rows with VNNI (12 accumulators, as the int16 tile's: vpdpbusd waits for the last
  // one into its accumulator), x 3 without (6 int16 pair sums and 6 int32 sums beside two weight
  // vectors and a broadcast). On a Zen 5 core under MINDIE_ISA=avx2, 3B prefill 512 at one plane:
  // with VNNI 4, 5 and 6 rows all 100-102 tok/s; without, 2, 3 and 4 rows 60, 69 and 65-67.
  static constexpr int kTilePanels = 1;
  static constexpr int kTileCols = Vnni ? 6 : 3;
  static constexpr bool kOnePlaneOnly = true;

  // out[(r * C + c) * 16 + lane] = f of panel r's row `lane` and activation row c (hi planes only).
  template <int R, int C, QFormat F>
  static void tile(const StagedPanel<int8_t>* w, const ActRef* x, int64_t groups, float* out) {
    constexpr QFormatInfo info = qformat_info(static_cast<int>(F));
    constexpr bool Signed = info.signed_q;
    constexpr int S = info.scale_span / 16, kSteps = 4 * S, kPairs = std::min(int16_pair_sums(F), kSteps);
    __m256 f[R][C][2];
    clear(f);
    for (int64_t j = 0; j < groups; j += S) {
      __m256i acc[R][C][2];
      clear(acc);
      for (int v0 = 0; v0 < kSteps; v0 += kPairs) {
        __m256i pairs[R][C][2];
        clear(pairs);
        for (int v = v0; v < v0 + kPairs; ++v) {
          __m256i wq[R][2];
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h)
              wq[r][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r].q + j * kPanelGroupValues + v * 64 + 32 * h));
          for (int c = 0; c < C; ++c) {
            const __m256i b = broadcast4(x[c].hi + 16 * j + 4 * v);
            for (int r = 0; r < R; ++r)
              for (int h = 0; h < 2; ++h) {
                const __m256i u = Signed ? _mm256_abs_epi8(wq[r][h]) : wq[r][h];
                const __m256i s = Signed ? _mm256_sign_epi8(b, wq[r][h]) : b;
                if constexpr (Vnni) acc[r][c][h] = dot(acc[r][c][h], u, s);
                else pairs[r][c][h] = _mm256_add_epi16(pairs[r][c][h], _mm256_maddubs_epi16(u, s));
              }
          }
        }
        if constexpr (!Vnni)
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c)
              for (int h = 0; h < 2; ++h)
                acc[r][c][h] = _mm256_add_epi32(acc[r][c][h], _mm256_madd_epi16(pairs[r][c][h], _mm256_set1_epi16(128)));
      }
      if constexpr (Vnni)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c)
            for (int h = 0; h < 2; ++h) acc[r][c][h] = _mm256_slli_epi32(acc[r][c][h], 7);
      Int8Panel<Vnni>::template add_span<R, C, Signed, S>(w, x, j, acc, f);
    }
    store(f, out);
  }
};

inline int32_t plane_sum16(const int8_t* hi, const int8_t* lo) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi));
  const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo));
  const __m256i v = _mm256_add_epi16(_mm256_slli_epi16(_mm256_cvtepi8_epi16(h), 7), _mm256_cvtepi8_epi16(l));
  __m256i s = _mm256_madd_epi16(v, _mm256_set1_epi16(1));  // 8 int32 pair sums; 128 * hi + lo fits int16
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(t);
}

inline void store_int8x32(int8_t* dst, const __m256i* w) {
  // packs interleave 128-bit lanes; the permute puts the 32 values back in order.
  const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline float quantize_block32(const float* x, int8_t* hi, int8_t* lo) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  const float amax = VecF(m).reduce_max();
  const float inv = amax > 0.f ? 127.f / amax : 0.f, step = amax / 127.f;
  const __m256 iv = _mm256_set1_ps(inv), iv_lo = _mm256_set1_ps(inv * 128.f), sv = _mm256_set1_ps(step);
  __m256i qh[4], ql[4];
  for (int i = 0; i < 4; ++i) {
    qh[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
    const __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(qh[i]), sv, v[i]);
    ql[i] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, iv_lo));
  }
  store_int8x32(hi, qh);
  store_int8x32(lo, ql);
  return step / 128.f;
}

#else  // scalar

template <bool Vnni>
struct Int8Panel : ByteStaging {
  static constexpr int kTilePanels = 1;
  static constexpr int kTileCols = 2;
  static constexpr int kStreamCols = 0;  // no streaming path: every row goes through staged panels
  static constexpr bool kOnePlaneOnly = false;
  template <int R, int C, QFormat F, int P>
  static void tile(const StagedPanel<int8_t>* w, const ActRef* x, int64_t groups, float* out) {
    constexpr QFormatInfo info = qformat_info(static_cast<int>(F));
    constexpr bool Signed = info.signed_q;
    constexpr int S = info.scale_span / 16;
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int lane = 0; lane < kPanelRows; ++lane) {
          float f = 0.f;
          for (int64_t j = 0; j < groups; j += S) {
            int32_t hi = 0, lo = 0;
            for (int i = 0; i < 16 * S; ++i) {
              const int32_t q = w[r].q[j * kPanelGroupValues + (i / 4) * 64 + lane * 4 + i % 4];
              hi += q * x[c].hi[16 * j + i];
              if constexpr (P == 2) lo += q * x[c].lo[16 * j + i];
            }
            f = std::fma(static_cast<float>(hi * 128 + lo), w[r].scale[16 * j + lane] * x[c].d[j / 2], f);
            if constexpr (!Signed) f = std::fma(w[r].offset[16 * j + lane], x[c].template sum<S>(j / S), f);
          }
          out[(r * C + c) * 16 + lane] = f;
        }
  }
};

inline int32_t plane_sum16(const int8_t* hi, const int8_t* lo) {
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += 128 * hi[i] + lo[i];
  return s;
}

inline float quantize_block32(const float* x, int8_t* hi, int8_t* lo) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f, step = amax / 127.f;
  for (int i = 0; i < 32; ++i) {
    const float qh = std::nearbyint(x[i] * inv);
    hi[i] = static_cast<int8_t>(qh);
    lo[i] = static_cast<int8_t>(std::fmax(-127.f, std::fmin(127.f, std::nearbyint((x[i] - qh * step) * (inv * 128.f)))));
  }
  return step / 128.f;
}

#endif

// The bf16 panel path without native bf16 dot products: the same bf16 weights, and per output
// element the same float32 sums of exact products, odd value of a pair first as vdpbf16ps adds them
// (denormals aside, which vdpbf16ps flushes). Scalar code for the variants that are never the fast
// choice for bf16 (qmatmul_bf16_native is false there).
struct Bf16PanelGeneric {
  static constexpr int kTilePanels = 1;
  static constexpr int kTileCols = 1;
  static constexpr int kRowBlock = 1;  // rows read one by one (vec_amx.h reads blocks)
  struct Session {};                    // no per-thread state to set up
  // Block b of a packed panel as bf16 pairs (Bf16Panel::stage_block's layout) at out, row by row.
  template <QFormat F>
  static void stage_block(const uint8_t* panel, int64_t blocks, int64_t b, bf16_t* out) {
    constexpr int S = packed_unit(F).span_groups;
    for (int r = 0; r < kPanelRows; ++r)
      with_decoded_block<Lanes1, F>(panel, blocks, b, r, [&](const auto* u, const auto* s, const auto* o) {
        for (int v = 0; v < 8; ++v)
          for (int i = 0; i < 4; ++i) {
            const int g = v / 4;
            const float q = Lanes1::to_float(Lanes1::sbyte(u[v], i));
            out[g * kBf16PanelGroupElems + (2 * (v % 4) + i / 2) * 32 + 2 * r + i % 2] =
                float_to_bf16(std::fma(q, s[S == 2 ? 0 : g], o[S == 2 ? 0 : g]));
          }
      });
  }
  template <int R, int C>
  static void tile(const bf16_t* const* w, const bf16_t* const* x, int64_t pairs, float* out) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int lane = 0; lane < kPanelRows; ++lane) {
          float f = 0.f;
          for (int64_t p = 0; p < pairs; ++p) {
            const bf16_t* wp = w[r] + 32 * p + 2 * lane;
            f = std::fma(bf16_to_float(wp[1]), bf16_to_float(x[c][2 * p + 1]), f);
            f = std::fma(bf16_to_float(wp[0]), bf16_to_float(x[c][2 * p]), f);
          }
          out[(r * C + c) * 16 + lane] = f;
        }
  }
};

#if defined(MINDIE_ISA_AVX512) && defined(MINDIE_BF16_DOT)
// vdpbf16ps over bf16 panels: each output element is one lane's float32 chain over the pairs in k
// order, whatever the tile or the number of activation rows.
struct Bf16Panel {
  // 4 panels x 6 activation rows: 24 accumulators, four weight vectors and a broadcast.
  static constexpr int kTilePanels = 4;
  static constexpr int kTileCols = 6;
  static constexpr int kRowBlock = 1;
  struct Session {};
  // Block b of a packed panel as bf16 pairs at out (its two 16-value groups), decoded straight from
  // the panel (no int8 staging): for group g, vector 2v + h's 4-byte lane r holds values 4v + 2h and
  // 4v + 2h + 1 of row r, each scale * q + offset rounded as float_to_bf16 rounds.
  template <QFormat F>
  static void stage_block(const uint8_t* panel, int64_t blocks, int64_t b, bf16_t* out) {
    static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    constexpr int S = packed_unit(F).span_groups;
    with_decoded_block<Lanes, F>(panel, blocks, b, 0, [out](const __m512i* u, const __m512* s, const __m512* o) {
      const __m512i interleave = _mm512_loadu_si512(kInterleave);
      for (int v = 0; v < 8; ++v) {
        const int g = v / 4;
        const __m512 scale = s[S == 2 ? 0 : g], offset = o[S == 2 ? 0 : g];
        // u[v]'s bytes are signed values (Q8_0) or values below 64: sign-extended either way
        __m512 f[4];
        f[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(u[v], 24), 24));
        f[1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(u[v], 16), 24));
        f[2] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(u[v], 8), 24));
        f[3] = _mm512_cvtepi32_ps(_mm512_srai_epi32(u[v], 24));
        bf16_t* dst = out + g * kBf16PanelGroupElems + 2 * (v % 4) * 32;
        for (int h = 0; h < 2; ++h) {
          // cvtne2ps puts the first operand's 16 values in the upper half: lane r pairs value 2h
          // (lower half) with 2h + 1 (upper half) after the interleave.
          const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(f[2 * h + 1], scale, offset),
                                                           _mm512_fmadd_ps(f[2 * h], scale, offset));
          _mm512_storeu_si512(dst + h * 32, _mm512_permutexvar_epi16(interleave, pair));
        }
      }
    });
  }
  template <int R, int C>
  static void tile(const bf16_t* const* w, const bf16_t* const* x, int64_t pairs, float* out) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512i wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w[r] + 32 * p);
      for (int c = 0; c < C; ++c) {
        int32_t xv;
        std::memcpy(&xv, x[c] + 2 * p, 4);
        const __m512i b = _mm512_set1_epi32(xv);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)wv[r], (__m512bh)b);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (r * C + c) * 16, acc[r][c]);
  }
};
#endif

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
