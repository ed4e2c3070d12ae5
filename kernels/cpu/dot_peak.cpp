// Register-only throughput loops (see dot_peak.h). Enough independent accumulators to cover the
// instruction's latency at two per cycle; the operands stay in registers, so only the execution
// ports count.
#include "cpu/dot_peak.h"

#include <algorithm>
#include <atomic>

#include "cpu/dispatch.h"
#include "cpu/parallel.h"
#include "cpu/vec.h"
#include "cpu/vec_amx.h"
#include "cpu/vec_int8.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

constexpr int kChains = 12;

#if defined(MINDIE_ISA_AVX512) || defined(MINDIE_ISA_AVX2)
#if defined(MINDIE_ISA_AVX512)
using VecI = __m512i;
constexpr int kBytes = 64;
inline VecI set1_i8(int8_t v) { return _mm512_set1_epi8(v); }
inline VecI set1_i32(int32_t v) { return _mm512_set1_epi32(v); }
inline VecI load_i8(const int8_t* p) { return _mm512_loadu_si512(p); }
inline VecI maddubs(VecI acc, VecI u, VecI s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
inline VecI maddwd(VecI acc, VecI u, VecI s) { return _mm512_add_epi32(acc, _mm512_madd_epi16(u, s)); }
inline int32_t fold(VecI v) { return _mm512_reduce_add_epi32(v); }
#else
using VecI = __m256i;
constexpr int kBytes = 32;
inline VecI set1_i8(int8_t v) { return _mm256_set1_epi8(v); }
inline VecI set1_i32(int32_t v) { return _mm256_set1_epi32(v); }
inline VecI load_i8(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VecI maddubs(VecI acc, VecI u, VecI s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline VecI maddwd(VecI acc, VecI u, VecI s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(u, s)); }
inline int32_t fold(VecI v) {
  alignas(32) int32_t a[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), v);
  int32_t s = 0;
  for (int32_t x : a) s += x;
  return s;
}
#endif

// The sum of every lane, kept so that the compiler cannot drop the loop.
std::atomic<int64_t> g_sink{0};

// u and s are the operands of every step: small bytes for the integer forms, and for bf16 1.0 in
// each half (0x3F80), whose sums stay normal floats (no denormal assists).
template <class Step>
int64_t run_chains(int64_t iterations, VecI u, VecI s, Step&& step) {
  VecI acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = set1_i8(0);
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = step(acc[c], u, s);
  int64_t sum = 0;
  for (int c = 0; c < kChains; ++c) sum += fold(acc[c]);
  g_sink.fetch_add(sum, std::memory_order_relaxed);
  return iterations * kChains * kBytes;
}

// The prompt tiles' forms (and vpmaddubsw) as the tiles run them: two weight vectors against kRows
// broadcasts into as many accumulators per weight, the operands loaded from L1 at an index that
// changes each round. With operands in registers GCC, seeing loop-invariant products, computes them
// once outside the loop and times vpaddd alone (1.4x vpmaddubsw's real rate on a Sapphire Rapids
// core); a chain of products feeding each on the last (acc + f(acc)) is held by its latency instead
// (vpmaddwd there at 0.7x this loop's rate). kRows is six on AVX-512 and for AVX-VNNI's vpdpwssd
// (as the tiles take them): each vpdpwssd waits 5 cycles for the last one into its accumulator, and
// four rows' 8 accumulators held a Sapphire Rapids core to 5.5 G of them a second against 7.6 with
// 12 (and 7.8 in register-only chains). Four for AVX2's other forms, as its tile.
template <int kRows = kBytes == 64 ? 6 : 4, class Step>
int64_t run_tile(int64_t iterations, Step&& step) {
  constexpr int kRounds = 8, kAcc = 2 * kRows;
  alignas(64) int8_t w[kRounds][2][kBytes];
  alignas(64) int32_t b[kRounds][kRows];
  std::fill(&w[0][0][0], &w[0][0][0] + sizeof(w), int8_t{3});
  std::fill(&b[0][0], &b[0][0] + kRounds * kRows, 0x01010101);
  asm volatile("" : : "r"(&w[0][0][0]), "r"(&b[0][0]) : "memory");  // values the compiler cannot know
  VecI acc[kAcc];
  for (int t = 0; t < kAcc; ++t) acc[t] = set1_i8(0);
  for (int64_t i = 0; i < iterations; ++i) {
    const int r = static_cast<int>(i % kRounds);
    for (int t = 0; t < kAcc; ++t) acc[t] = step(acc[t], load_i8(w[r][t % 2]), set1_i32(b[r][t / 2]));
  }
  int64_t sum = 0;
  for (int t = 0; t < kAcc; ++t) sum += fold(acc[t]);
  g_sink.fetch_add(sum, std::memory_order_relaxed);
  return iterations * kAcc * kBytes;
}
#endif

#if defined(MINDIE_AMX)
// Four accumulator tiles against two A and two B tiles of 1.0 (0x3F80), as AmxBf16Panel::tile runs
// them: each tdpbf16ps is 16 x 16 x 32 products.
int64_t amx_bf16(int64_t iterations) {
  alignas(64) uint16_t ones[16 * 32];
  std::fill(ones, ones + 16 * 32, uint16_t{0x3F80});
  const AmxBf16Panel::Session session;
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  // Sums grow by 32 per step: iterations stay far below float32's 2^24 integer limit in the probes
  // dot_peak runs, and the value is never read but for the sink.
  for (int64_t i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  g_sink.fetch_add(static_cast<int64_t>(out[0]), std::memory_order_relaxed);
  return iterations * 4 * 16 * 16 * 32;
}
#endif

int64_t one_thread(DotInstr instr, int64_t iterations) {
#if defined(MINDIE_AMX)
  if (instr == DotInstr::kTdpbf16ps && use_amx_bf16()) return amx_bf16(iterations);
#endif
#if defined(MINDIE_ISA_AVX512) && defined(MINDIE_VNNI)
  if (instr == DotInstr::kVpdpwssd && use_avx512_vnni())  // one product per 2 bytes
    return run_tile(iterations, [](VecI acc, VecI u, VecI s) { return _mm512_dpwssd_epi32(acc, u, s); }) / 2;
  if (instr == DotInstr::kVpdpbusd && use_avx512_vnni())
    return run_chains(iterations, set1_i8(3), set1_i8(1),
                      [](VecI acc, VecI u, VecI s) { return _mm512_dpbusd_epi32(acc, u, s); });
#endif
#if defined(MINDIE_ISA_AVX2) && defined(MINDIE_AVX_VNNI)
  if (instr == DotInstr::kVpdpwssd && use_avx_vnni())  // the AVX2 prompt tile's products
    return run_tile<Int8Panel<true>::kTileCols>(
               iterations, [](VecI acc, VecI u, VecI s) { return Int8Panel<true>::dot_pairs(acc, u, s); }) / 2;
  if (instr == DotInstr::kVpdpbusd && use_avx_vnni())
    return run_chains(iterations, set1_i8(3), set1_i8(1),
                      [](VecI acc, VecI u, VecI s) { return Int8Panel<true>::dot(acc, u, s); });
#endif
#if defined(MINDIE_ISA_AVX512) && defined(MINDIE_BF16_DOT)
  if (instr == DotInstr::kVdpbf16ps && cpu_has_avx512_bf16())
    return run_chains(iterations, _mm512_set1_epi16(0x3F80), _mm512_set1_epi16(0x3F80), [](VecI acc, VecI u, VecI s) {
             return _mm512_castps_si512(_mm512_dpbf16_ps(_mm512_castsi512_ps(acc), (__m512bh)u, (__m512bh)s));
           }) / 2;  // 32 bf16 pairs of products per 64 bytes
#endif
#if defined(MINDIE_ISA_AVX512) || defined(MINDIE_ISA_AVX2)
  if (instr == DotInstr::kVpmaddubsw)
    return run_tile(iterations, [](VecI acc, VecI u, VecI s) { return maddubs(acc, u, s); });
  if (instr == DotInstr::kVpmaddwd)  // one product per 2 bytes
    return run_tile(iterations, [](VecI acc, VecI u, VecI s) { return maddwd(acc, u, s); }) / 2;
#endif
  (void)instr;
  (void)iterations;
  return 0;
}

}  // namespace

void dot_peak(const DotPeakArgs& a) {
  std::atomic<int64_t> total{0};
  parallel_for(a.threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) total.fetch_add(one_thread(a.instr, a.iterations), std::memory_order_relaxed);
  });
  *a.products += total.load();
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
