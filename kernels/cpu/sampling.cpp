#include "cpu/sampling.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "cpu/parallel.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

constexpr int kBuckets = 4096;           // histogram buckets over max z - z
constexpr float kBucketRange = 64.f;     // z below max - 64 (weight < 1.7e-28) share the last one

// ---- Philox4x32-10 (Salmon et al., SC'11; the Random123 constants) --------------------------

inline void philox4x32_10(uint32_t ctr[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * ctr[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * ctr[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    const uint32_t n0 = hi1 ^ ctr[1] ^ k0, n2 = hi0 ^ ctr[3] ^ k1;
    ctr[0] = n0;
    ctr[1] = lo1;
    ctr[2] = n2;
    ctr[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// One uniform double in [0, 1) with 53 random bits, keyed by the row's seed, counted by its step.
inline double philox_uniform(int64_t seed, int64_t step) {
  const uint64_t s = static_cast<uint64_t>(seed), t = static_cast<uint64_t>(step);
  uint32_t ctr[4] = {static_cast<uint32_t>(t), static_cast<uint32_t>(t >> 32), 0u, 0u};
  philox4x32_10(ctr, static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  const uint64_t a = ctr[0] >> 5, b = ctr[1] >> 6;  // 27 + 26 bits
  return static_cast<double>(a * 67108864ull + b) * (1.0 / 9007199254740992.0);
}

// ---- row helpers (VecF) ----------------------------------------------------------------------

// Sanitising copy into float32: NaN -> -inf, +inf -> FLT_MAX. Returns the row max.
// VecF::max(v, -inf) yields -inf for a NaN v on every variant (the second operand wins).
template <typename T>
float copy_sanitize(float* dst, const T* src, int n) {
  constexpr int W = VecF::W;
  const VecF lo = VecF::set1(-INFINITY), hi = VecF::set1(FLT_MAX);
  VecF m = lo;
  int i = 0;
  for (; i + W <= n; i += W) {
    VecF v = VecF::min(VecF::max(VecF::load(src + i), lo), hi);
    v.store(dst + i);
    m = VecF::max(v, m);
  }
  if (i < n) {
    VecF v = VecF::min(VecF::max(VecF::load_partial(src + i, n - i, -INFINITY), lo), hi);
    v.store_partial(dst + i, n - i);
    m = VecF::max(v, m);
  }
  return m.reduce_max();
}

inline float sanitize(float v) {
  if (v != v) return -INFINITY;
  return v > FLT_MAX ? FLT_MAX : v;
}

// sum_i exp(x[i] - m) without writing x.
inline float exp_sum(const float* x, float m, int n) {
  constexpr int W = VecF::W;
  const VecF mv = VecF::set1(m);
  VecF acc0 = VecF::zero(), acc1 = VecF::zero();
  int i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    acc0 = acc0 + VecF::exp(VecF::load(x + i) - mv);
    acc1 = acc1 + VecF::exp(VecF::load(x + i + W) - mv);
  }
  for (; i + W <= n; i += W) acc0 = acc0 + VecF::exp(VecF::load(x + i) - mv);
  if (i < n) acc1 = acc1 + VecF::exp(VecF::load_partial(x + i, n - i, -INFINITY) - mv);
  return (acc0 + acc1).reduce_add();
}

// In place x[i] = min(x[i] / t, FLT_MAX) (a true division, as torch does); returns the new max.
inline float divide_clamp(float* x, float t, int n) {
  constexpr int W = VecF::W;
  const VecF tv = VecF::set1(t), hi = VecF::set1(FLT_MAX);
  VecF m = VecF::set1(-INFINITY);
  int i = 0;
  for (; i + W <= n; i += W) {
    VecF v = VecF::min(VecF::load(x + i) / tv, hi);
    v.store(x + i);
    m = VecF::max(v, m);
  }
  if (i < n) {
    VecF v = VecF::min(VecF::load_partial(x + i, n - i, -INFINITY) / tv, hi);
    v.store_partial(x + i, n - i);
    m = VecF::max(v, m);
  }
  return m.reduce_max();
}

// Max over x[i .. i + 4W).
inline float chunk_max(const float* x) {
  constexpr int W = VecF::W;
  VecF a = VecF::max(VecF::load(x), VecF::load(x + W));
  VecF b = VecF::max(VecF::load(x + 2 * W), VecF::load(x + 3 * W));
  return VecF::max(a, b).reduce_max();
}

// p[0..n) = (int32) truncation of v's first n lanes (n <= W); lanes hold values in [0, 2^31).
inline void store_trunc(int32_t* p, VecF v, int n) {
#if defined(MINDIE_ISA_AVX512)
  _mm512_mask_storeu_epi32(p, static_cast<__mmask16>((1u << n) - 1u), _mm512_cvttps_epi32(v.v));
#elif defined(MINDIE_ISA_AVX2)
  _mm256_maskstore_epi32(p, VecF::tail_mask(n), _mm256_cvttps_epi32(v.v));
#else
  if (n > 0) *p = static_cast<int32_t>(v.v);
#endif
}

// The indices i < n with bid[i] == b, ascending, into out; returns how many.
inline int gather_bucket(const int32_t* bid, int n, int b, int32_t* out) {
  int m = 0, i = 0;
#if defined(MINDIE_ISA_AVX512)
  const __m512i bv = _mm512_set1_epi32(b);
  for (; i + 16 <= n; i += 16) {
    uint32_t mask = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(bid + i), bv);
    for (; mask != 0; mask &= mask - 1) out[m++] = i + __builtin_ctz(mask);
  }
#elif defined(MINDIE_ISA_AVX2)
  const __m256i bv = _mm256_set1_epi32(b);
  for (; i + 8 <= n; i += 8) {
    const __m256i eq = _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bid + i)), bv);
    uint32_t mask = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(eq)));
    for (; mask != 0; mask &= mask - 1) out[m++] = i + __builtin_ctz(mask);
  }
#endif
  for (; i < n; ++i)
    if (bid[i] == b) out[m++] = i;
  return m;
}

// First index of the maximum (ties: lowest index). x has no NaN.
int32_t argmax(const float* x, int n) {
  constexpr int C = 4 * VecF::W;
  const float m = row_max(x, n);
  int i = 0;
  for (; i + C <= n; i += C) {
    if (chunk_max(x + i) != m) continue;
    for (int j = i; j < i + C; ++j)
      if (x[j] == m) return j;
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // unreachable for NaN-free rows
}

struct Cand {
  float v;
  int32_t i;
};
// Strict total order: larger value first, then lower index. Values are never NaN here.
inline bool better(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

// Max over x[i .. i + W).
inline float vec_max(const float* x) { return VecF::load(x).reduce_max(); }

// The k best of x[0..n) (1 <= k <= n) in `out`, best first, without sorting the row.
// Chunk maxima bound the answer: the k-th largest chunk max m is <= the k-th largest value (k
// chunks each hold a value >= m), so only values >= m in chunks whose max is >= m can be among
// the k best; those few candidates are partially sorted. Chunks are 4W or W values wide, whichever
// leaves at least 2k chunks; a row too short for that uses every value as a candidate.
void top_k_select(const float* x, int n, int k, std::vector<float>& cmax, std::vector<Cand>& out) {
  constexpr int W = VecF::W;
  out.clear();
  int C = 4 * W;
  if (n / C < 2 * k) C = W;
  const int nc = n / C;  // full chunks; the tail is always scanned
  if (nc >= 2 * k && C > 1) {
    cmax.resize(2 * static_cast<size_t>(nc));
    float* cm = cmax.data();
    float* sel = cm + nc;
    for (int c = 0; c < nc; ++c) cm[c] = C == W ? vec_max(x + c * C) : chunk_max(x + c * C);
    std::copy(cm, cm + nc, sel);
    std::nth_element(sel, sel + (k - 1), sel + nc, std::greater<float>());
    const float m = sel[k - 1];
    for (int c = 0; c < nc; ++c) {
      if (!(cm[c] >= m)) continue;
      for (int i = c * C; i < (c + 1) * C; ++i)
        if (x[i] >= m) out.push_back({x[i], i});
    }
    for (int i = nc * C; i < n; ++i)
      if (x[i] >= m) out.push_back({x[i], i});
  } else {
    for (int i = 0; i < n; ++i) out.push_back({x[i], i});
  }
  if (static_cast<int>(out.size()) > k) {
    std::nth_element(out.begin(), out.begin() + (k - 1), out.end(), better);
    out.resize(k);
  }
  std::sort(out.begin(), out.end(), better);
}

// Float32 product that the compiler may not fuse into a following add (torch does not fuse).
inline float mul_nofma(float a, float b) {
  volatile float r = a * b;
  return r;
}

// ---- per-thread scratch ----------------------------------------------------------------------

struct Scratch {
  std::vector<float> x;        // sanitised logits -> penalised -> z
  std::vector<float> w;        // weights exp(z - max z) (histogram path)
  std::vector<int32_t> bid;    // bucket of each token (histogram path)
  std::vector<int32_t> cand;   // token ids of the gathered buckets
  std::vector<int32_t> count;  // output token counts; all zero between rows
  std::vector<uint8_t> mark;   // repetition-penalty marks; all zero between rows
  std::vector<int32_t> touched;
  std::vector<Cand> top;       // top-k candidates
  std::vector<float> cmax;     // chunk maxima for top_k_select
  std::vector<double> cum;
  std::vector<int32_t> hcount, hstart;
  std::vector<double> hmass;
  std::vector<uint8_t> hsorted;

  void prepare(int V) {
    if (static_cast<int>(x.size()) < V) {
      x.resize(V);
      w.resize(V);
      bid.resize(V);
      cand.resize(V);
      count.resize(V, 0);  // new elements are zero, old ones are zero already
      mark.resize(V, 0);
    }
    if (hcount.empty()) {
      hcount.resize(kBuckets);
      hstart.resize(kBuckets + 1);
      hmass.resize(kBuckets);
      hsorted.resize(kBuckets);
    }
  }
};

thread_local Scratch t_scratch;

void apply_penalties(const SampleArgs& a, int64_t row, float* x, Scratch& s) {
  const float rp = a.repetition_penalty ? a.repetition_penalty[row] : 1.f;
  const float pres = a.presence_penalty ? a.presence_penalty[row] : 0.f;
  const float freq = a.frequency_penalty ? a.frequency_penalty[row] : 0.f;
  const int64_t* pt = nullptr;
  const int64_t* ot = nullptr;
  int64_t np = 0, no = 0;
  if (a.prompt_tokens && a.prompt_offsets) {
    pt = a.prompt_tokens + a.prompt_offsets[row];
    np = a.prompt_offsets[row + 1] - a.prompt_offsets[row];
  }
  if (a.output_tokens && a.output_offsets) {
    ot = a.output_tokens + a.output_offsets[row];
    no = a.output_offsets[row + 1] - a.output_offsets[row];
  }
  if (rp != 1.f && np + no > 0) {
    s.touched.clear();
    auto penalise = [&](int64_t t) {
      if (s.mark[t]) return;
      s.mark[t] = 1;
      s.touched.push_back(static_cast<int32_t>(t));
      const float v = x[t];
      x[t] = v > 0.f ? v / rp : v * rp;
    };
    for (int64_t j = 0; j < np; ++j) penalise(pt[j]);
    for (int64_t j = 0; j < no; ++j) penalise(ot[j]);
    for (int32_t t : s.touched) s.mark[t] = 0;
  }
  if ((pres != 0.f || freq != 0.f) && no > 0) {
    s.touched.clear();
    for (int64_t j = 0; j < no; ++j)
      if (s.count[ot[j]]++ == 0) s.touched.push_back(static_cast<int32_t>(ot[j]));
    for (int32_t t : s.touched) {
      const float pen = pres + mul_nofma(freq, static_cast<float>(s.count[t]));
      x[t] = x[t] - pen;
      s.count[t] = 0;
    }
  }
}

// Top-k <= kSmallTopK: partial selection over z, then top-p and the draw over the sorted candidates.
int32_t draw_small_k(const float* z, int V, int K, float top_p, double u, Scratch& s) {
  top_k_select(z, V, K, s.cmax, s.top);
  const std::vector<Cand>& c = s.top;
  const float zmax = c[0].v;
  s.cum.resize(K);
  double* cum = s.cum.data();
  double acc = 0.0;
  for (int j = 0; j < K; ++j) {
    acc += static_cast<double>(std::exp(c[j].v - zmax));
    cum[j] = acc;
  }
  int L = K;
  if (top_p < 1.f) {
    const double T = static_cast<double>(top_p) * cum[K - 1];
    for (int j = 0; j < K; ++j)
      if (cum[j] >= T) {
        L = j + 1;
        break;
      }
  }
  const double target = u * cum[L - 1];
  for (int j = 0; j < L; ++j)
    if (cum[j] > target) return c[j].i;
  for (int j = L - 1; j > 0; --j)  // rounding: the last kept candidate with a positive weight
    if (cum[j] > cum[j - 1]) return c[j].i;
  return c[0].i;
}

// Large k, top-p alone or plain sampling: histogram of the weights over max z - z, then only the
// buckets holding the top-k, top-p and draw boundaries are sorted.
int32_t draw_histogram(const float* z, float zmax, int V, int K, float top_p, double u, Scratch& s) {
  constexpr int W = VecF::W;
  float* w = s.w.data();
  int32_t* bid = s.bid.data();
  int32_t* hcount = s.hcount.data();
  double* hmass = s.hmass.data();
  std::fill(hcount, hcount + kBuckets, 0);
  std::fill(hmass, hmass + kBuckets, 0.0);

  // Bucket b = min(trunc((zmax - z) * inv), last): monotone in z (correctly rounded sub and mul,
  // min, truncation), so the bucket order is the candidate order.
  const VecF mv = VecF::set1(zmax);
  const VecF invv = VecF::set1(static_cast<float>(kBuckets) / kBucketRange);
  const VecF lastv = VecF::set1(static_cast<float>(kBuckets - 1));
  constexpr int kBlock = 256;
  for (int i0 = 0; i0 < V; i0 += kBlock) {
    const int i1 = std::min(V, i0 + kBlock);
    int i = i0;
    for (; i + W <= i1; i += W) {
      const VecF zv = VecF::load(z + i);
      VecF::exp(zv - mv).store(w + i);
      store_trunc(bid + i, VecF::min((mv - zv) * invv, lastv), W);
    }
    if (i < i1) {
      const VecF zv = VecF::load_partial(z + i, i1 - i, -INFINITY);
      VecF::exp(zv - mv).store_partial(w + i, i1 - i);
      store_trunc(bid + i, VecF::min((mv - zv) * invv, lastv), i1 - i);
    }
    for (i = i0; i < i1; ++i) {
      const int b = bid[i];
      hcount[b] += 1;
      hmass[b] += static_cast<double>(w[i]);
    }
  }

  // Boundary of the top-k prefix: bucket bK, of which the first rK tokens are in.
  int bK = kBuckets - 1, rK = hcount[kBuckets - 1];
  if (K < V) {
    int64_t c = 0;
    for (int b = 0; b < kBuckets; ++b) {
      if (c + hcount[b] >= K) {
        bK = b;
        rK = static_cast<int>(K - c);
        break;
      }
      c += hcount[b];
    }
  }
  // Top-k off: the walks below stop at the top-p (or draw) bucket the histogram points to.
  int bmax = bK;
  double total = 0.0;
  if (K == V) {
    for (int b = 0; b < kBuckets; ++b) total += hmass[b];
    const double T = top_p < 1.f ? static_cast<double>(top_p) * total : u * total;
    double acc = 0.0;
    for (int b = 0; b < kBuckets; ++b) {
      if (hcount[b] == 0) continue;
      bmax = b;
      if (top_p < 1.f ? acc + hmass[b] >= T : acc + hmass[b] > T) break;
      acc += hmass[b];
    }
    rK = hcount[bmax];
    bK = bmax;
  }

  // Buckets are gathered (one SIMD scan each) and sorted only when a walk enters them: at most
  // the top-k, top-p and draw boundary buckets.
  int32_t* hstart = s.hstart.data();
  uint8_t* hsorted = s.hsorted.data();
  std::fill(hsorted, hsorted + kBuckets, 0);
  int32_t* cand = s.cand.data();
  int32_t used = 0;
  auto sorted = [&](int b) -> const int32_t* {
    if (!hsorted[b]) {
      int32_t* p = cand + used;
      const int n = gather_bucket(bid, V, b, p);
      hstart[b] = used;
      used += n;
      auto cmp = [z](int32_t a, int32_t c) { return z[a] > z[c] || (z[a] == z[c] && a < c); };
      if (!std::is_sorted(p, p + n, cmp)) std::sort(p, p + n, cmp);
      hsorted[b] = 1;
    }
    return cand + hstart[b];
  };
  // Tokens of bucket b inside the prefix that ends at (bucket be, count re).
  auto limit = [&](int b, int be, int re) { return b == be ? re : hcount[b]; };

  // Weight of the top-k prefix (everything when top-k is off), accumulated like the walks below.
  double Mk = total;
  if (K < V) {
    Mk = 0.0;
    for (int b = 0; b < bK; ++b) Mk += hmass[b];
    const int32_t* p = sorted(bK);
    for (int j = 0; j < rK; ++j) Mk += static_cast<double>(w[p[j]]);
  }

  // Top-p: the shortest prefix whose weight reaches top_p * Mk; it ends at (bL, rL).
  int bL = bK, rL = rK;
  double M = Mk;
  if (top_p < 1.f) {
    const double T = static_cast<double>(top_p) * Mk;
    double acc = 0.0;
    bool found = false;
    for (int b = 0; b <= bK && !found; ++b) {
      const int lim = limit(b, bK, rK);
      if (lim == hcount[b] && acc + hmass[b] < T) {
        acc += hmass[b];
        continue;
      }
      const int32_t* p = sorted(b);
      for (int j = 0; j < lim; ++j) {
        acc += static_cast<double>(w[p[j]]);
        if (acc >= T) {
          bL = b;
          rL = j + 1;
          found = true;
          break;
        }
      }
    }
    M = acc;  // rounding left T unreached: everything up to bK stays, acc is its weight
  }

  // The draw: the first kept token whose cumulative weight exceeds u * M.
  const double target = u * M;
  double acc = 0.0;
  for (int b = 0; b <= bL; ++b) {
    const int lim = limit(b, bL, rL);
    if (lim == hcount[b] && acc + hmass[b] <= target) {
      acc += hmass[b];
      continue;
    }
    const int32_t* p = sorted(b);
    for (int j = 0; j < lim; ++j) {
      acc += static_cast<double>(w[p[j]]);
      if (acc > target) return p[j];
    }
  }
  // Rounding: the last kept token with a positive weight (bucket 0 holds the max, weight 1).
  for (int b = bL; b >= 0; --b) {
    const int lim = limit(b, bL, rL);
    if (lim == 0 || hmass[b] <= 0.0) continue;
    const int32_t* p = sorted(b);
    for (int j = lim - 1; j >= 0; --j)
      if (w[p[j]] > 0.f) return p[j];
  }
  return sorted(0)[0];  // bucket 0 holds the max, weight 1: not reached
}

template <typename T>
void sample_row(const SampleArgs& a, int64_t row, Scratch& s) {
  const int V = static_cast<int>(a.vocab_size);
  const T* in = static_cast<const T*>(a.logits) + row * a.logits_row_stride;
  float* x = s.x.data();

  // Raw log_softmax statistics and the top-N, before any penalty.
  const float m0 = copy_sanitize(x, in, V);
  const float logsum0 = std::log(exp_sum(x, m0, V));
  const int N = a.num_top_logprobs;
  if (N > 0) {
    top_k_select(x, V, N, s.cmax, s.top);
    for (int j = 0; j < N; ++j) {
      a.out_top_ids[row * N + j] = s.top[j].i;
      a.out_top_logprobs[row * N + j] = (s.top[j].v - m0) - logsum0;
    }
  }

  apply_penalties(a, row, x, s);

  int32_t token;
  const float temp = a.temperature[row];
  if (temp == 0.f) {
    token = argmax(x, V);
  } else {
    const float zmax = divide_clamp(x, temp, V);
    if (zmax == -INFINITY) {
      token = 0;  // every token is impossible: the argmax convention
    } else {
      const int64_t k = a.top_k[row];
      const int K = (k <= 0 || k >= V) ? V : static_cast<int>(k);
      const double u = philox_uniform(a.seed[row], a.step[row]);
      const float p = a.top_p[row];
      token = K <= kSmallTopK ? draw_small_k(x, V, K, p, u, s) : draw_histogram(x, zmax, V, K, p, u, s);
    }
  }
  float raw;
  if constexpr (sizeof(T) == 4) raw = in[token];
  else raw = bf16_to_float(in[token]);
  a.out_tokens[row] = token;
  a.out_logprobs[row] = (sanitize(raw) - m0) - logsum0;
}

}  // namespace

void sample(const SampleArgs& a) {
  parallel_for(a.num_rows, 1, [&](int64_t begin, int64_t end) {
    Scratch& s = t_scratch;
    s.prepare(static_cast<int>(a.vocab_size));
    for (int64_t r = begin; r < end; ++r) {
      if (a.dtype == DType::kFloat32) sample_row<float>(a, r, s);
      else sample_row<bf16_t>(a, r, s);
    }
  });
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
