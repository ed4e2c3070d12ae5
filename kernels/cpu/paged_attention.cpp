#include "cpu/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/dispatch.h"
#include "cpu/parallel.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

constexpr int kQueryTile = 32;        // prefill queries per work item
// Prefill register tiles: query rows scored and accumulated together, and head-dimension vectors per
// accumulator row (4 rows x 4 vectors of scores or values fit AVX-512's registers, 2 x 4 AVX2's).
constexpr int kRowTile = VecF::W >= 16 ? 4 : 2;
constexpr int kAccVectors = 4;
constexpr int kMinPartition = 256;    // smallest decode split worth its merge

// One unit of parallel work. Decode: every head of one sequence over a range of its keys, so each
// cache block is read as one contiguous stream. Prefill: one kv head of one sequence over a tile
// of its queries. `part` >= 0 marks a decode split whose partial result goes to the workspace.
struct WorkItem {
  int32_t seq;
  int32_t kv_head;  // prefill only
  int32_t begin;  // decode: first key position; prefill: first query index within the sequence
  int32_t end;
  int64_t part;   // decode split slot in the workspace, or -1
};

// Running softmax state of `rows` query rows: max m, sum l and unnormalised output acc[rows][D].
struct OnlineSoftmax {
  float* m;
  float* l;
  float* acc;
  int head_dim;

  void init(int rows) {
    std::fill(m, m + rows, -INFINITY);
    std::fill(l, l + rows, 0.f);
    std::fill(acc, acc + static_cast<int64_t>(rows) * head_dim, 0.f);
  }
  // Turns scores s[0..n) of row r into probabilities relative to the new running max and rescales
  // the row's accumulator. Returns false when every score is masked (-inf): nothing to add.
  bool update(int r, float* s, int n) {
    const float m_old = m[r];
    if (!update_scores(r, s, n)) return false;
    if (m_old != m[r]) {
      float* a = acc + static_cast<int64_t>(r) * head_dim;
      load_scaled(a, a, m_old == -INFINITY ? 0.f : std::exp(m_old - m[r]), head_dim);
    }
    return true;
  }
  // The same without touching acc, for callers that keep the accumulator elsewhere.
  bool update_scores(int r, float* s, int n) {
    const float bm = row_max(s, n);
    if (bm == -INFINITY) return false;
    const float m_new = std::max(m[r], bm);
    const float alpha = m[r] == -INFINITY ? 0.f : std::exp(m[r] - m_new);
    l[r] = l[r] * alpha + exp_sub_sum(s, m_new, n);
    m[r] = m_new;
    return true;
  }
};

// Issues prefetches for the K then V bytes of the next block, a few cache lines per step(), so the
// whole block has been asked for after `steps` calls.
class PrefetchStream {
 public:
  PrefetchStream(const void* k, const void* v, int64_t bytes, int64_t steps)
      : k_(static_cast<const char*>(k)), v_(static_cast<const char*>(v)), lines_((bytes + 63) / 64),
        per_step_(steps > 0 ? (2 * lines_ + steps - 1) / steps : 0) {}
  void step() {
    for (int64_t i = 0; i < per_step_ && next_ < 2 * lines_; ++i, ++next_)
      __builtin_prefetch((next_ < lines_ ? k_ + next_ * 64 : v_ + (next_ - lines_) * 64), 0, 3);
  }

 private:
  const char* k_;
  const char* v_;
  int64_t lines_;
  int64_t per_step_;
  int64_t next_ = 0;
};

struct Scratch {
  std::vector<float> buf;
  float* get(size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
};

template <typename Q, typename KV>
class Attention {
 public:
  explicit Attention(const PagedAttentionArgs& a)
      : a_(a),
        q_(static_cast<const Q*>(a.query)),
        kc_(static_cast<const KV*>(a.key_cache)),
        vc_(static_cast<const KV*>(a.value_cache)),
        out_(static_cast<Q*>(a.out)),
        group_(a.num_heads / a.kv_heads),
        D_(a.head_dim),
        row_(static_cast<int64_t>(a.kv_heads) * a.head_dim) {}

  void run() {
    build_work();
    workspace_.assign(static_cast<size_t>(num_parts_) * a_.num_heads * (D_ + 2), 0.f);
    parallel_for(static_cast<int64_t>(work_.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const WorkItem& w = work_[i];
        if (w.part >= 0 || query_len(w.seq) == 1) decode(w);
        else prefill(w);
      }
    });
    if (!merges_.empty()) {
      parallel_for(static_cast<int64_t>(merges_.size()) * a_.num_heads, 4, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) merge(merges_[i / a_.num_heads], static_cast<int>(i % a_.num_heads));
      });
    }
  }

 private:
  struct Merge {
    int32_t seq;
    int64_t first_part;
    int32_t num_parts;
  };

  int query_len(int64_t s) const { return a_.query_start_loc[s + 1] - a_.query_start_loc[s]; }

  const KV* key_row(int64_t s, int pos, int kv_head) const {
    const int64_t block = a_.block_tables[s * a_.block_table_stride + pos / a_.block_size];
    return kc_ + (block * a_.block_size + pos % a_.block_size) * row_ + static_cast<int64_t>(kv_head) * D_;
  }
  const KV* value_row(int64_t s, int pos, int kv_head) const {
    const int64_t block = a_.block_tables[s * a_.block_table_stride + pos / a_.block_size];
    return vc_ + (block * a_.block_size + pos % a_.block_size) * row_ + static_cast<int64_t>(kv_head) * D_;
  }

  void build_work() {
    int64_t decode_rows = 0;
    for (int64_t s = 0; s < a_.num_seqs; ++s) decode_rows += query_len(s) == 1;
    int partition = a_.partition_size;
    if (partition <= 0) {
      // Split long decode contexts only when the batch alone cannot keep every thread busy.
      const int64_t want = 4LL * get_num_threads();
      const int64_t have = decode_rows;
      int64_t longest = 0;
      for (int64_t s = 0; s < a_.num_seqs; ++s)
        if (query_len(s) == 1) longest = std::max<int64_t>(longest, a_.seq_lens[s]);
      partition = static_cast<int>(longest + 1);
      if (have > 0 && have < want) {
        const int64_t splits = (want + have - 1) / have;
        partition = static_cast<int>(std::max<int64_t>(kMinPartition, (longest + splits - 1) / splits));
      }
    }
    partition = std::max(partition, 1);
    for (int64_t s = 0; s < a_.num_seqs; ++s) {
      const int q_len = query_len(s);
      const int ctx = a_.seq_lens[s];
      if (q_len == 0 || ctx == 0) continue;
      if (q_len == 1) {
        const int parts = (ctx + partition - 1) / partition;
        if (parts > 1) merges_.push_back({static_cast<int32_t>(s), num_parts_, parts});
        for (int p = 0; p < parts; ++p) {
          const int64_t slot = parts > 1 ? num_parts_ + p : -1;
          work_.push_back({static_cast<int32_t>(s), 0, p * partition, std::min(ctx, (p + 1) * partition), slot});
        }
        if (parts > 1) num_parts_ += parts;
      } else {
        for (int i0 = 0; i0 < q_len; i0 += kQueryTile)
          for (int h = 0; h < a_.kv_heads; ++h)
            work_.push_back({static_cast<int32_t>(s), h, i0, std::min(q_len, i0 + kQueryTile), -1});
      }
    }
    // Longest work first, so the dynamic schedule does not end on one straggler.
    std::stable_sort(work_.begin(), work_.end(), [&](const WorkItem& x, const WorkItem& y) {
      return cost(x) > cost(y);
    });
  }

  int64_t cost(const WorkItem& w) const {
    if (w.part >= 0 || query_len(w.seq) == 1) return static_cast<int64_t>(w.end - w.begin) * a_.kv_heads;
    const int64_t last_pos = a_.seq_lens[w.seq] - query_len(w.seq) + w.end;
    return last_pos * (w.end - w.begin);
  }

  // Loads the group's query rows of token `t` as float32, pre-multiplied by the softmax scale.
  void load_queries(float* qf, int64_t token, int kv_head) const {
    const Q* q = q_ + token * a_.q_token_stride + static_cast<int64_t>(kv_head) * group_ * D_;
    load_scaled(qf, q, a_.scale, group_ * D_);
  }

  void store_output(int64_t token, int head, const float* acc, float inv_l) const {
    store_scaled(out_ + token * a_.out_token_stride + static_cast<int64_t>(head) * D_, acc, inv_l, D_);
  }

  // One token's queries against keys [w.begin, w.end), a block at a time and, within a block, a
  // kv head at a time: scores, online-softmax update, then the weighted values. Head dims that
  // fill whole vectors keep queries and accumulators in registers (decode_fixed).
  void decode(const WorkItem& w) const {
    thread_local Scratch scratch;
    const int H = a_.num_heads, BS = a_.block_size, G = group_;
    float* qf = scratch.get(static_cast<size_t>(H) * (2 * D_ + 2) + static_cast<size_t>(G + 4) * BS + 64);
    float* acc = qf + H * D_;
    float* ml = acc + H * D_;
    float* s = ml + 2 * H;  // [G][BS] scores, reused per kv head, then [BS][4] for decode_fixed
    OnlineSoftmax sm{ml, ml + H, acc, D_};
    sm.init(H);
    const int64_t token = a_.query_start_loc[w.seq];
    load_scaled(qf, q_ + token * a_.q_token_stride, a_.scale, H * D_);
    for (int b0 = w.begin; b0 < w.end;) {
      const int n = std::min(w.end, (b0 / BS + 1) * BS) - b0;
      const int next = b0 + n;
      const int n_next = next < w.end ? std::min(w.end, (next / BS + 1) * BS) - next : 0;
      // While this block is computed, the next one streams into cache: blocks are scattered, so
      // the hardware prefetcher would restart at each one. Spread over the block's iterations.
      const int64_t next_bytes = static_cast<int64_t>(n_next) * row_ * static_cast<int64_t>(sizeof(KV));
      PrefetchStream ahead(n_next > 0 ? key_row(w.seq, next, 0) : nullptr,
                           n_next > 0 ? value_row(w.seq, next, 0) : nullptr, next_bytes,
                           a_.kv_heads * (n + (n + 1) / 2));
      const BlockRows rows{key_row(w.seq, b0, 0), value_row(w.seq, b0, 0), n, token, &ahead};
      for (int h = 0; h < a_.kv_heads; ++h)
        for (int g0 = 0; g0 < G; g0 += 4) {
          const int head0 = h * G + g0, gc = std::min(4, G - g0);
          if (!decode_fixed_dispatch(rows, h, head0, gc, qf, s, sm)) decode_general(rows, h, head0, gc, qf, s, sm);
        }
      b0 += n;
    }
    for (int head = 0; head < H; ++head) {
      if (w.part < 0) {
        store_output(token, head, acc + head * D_, sm.l[head] > 0.f ? 1.f / sm.l[head] : 0.f);
      } else {
        float* dst = workspace_.data() + (w.part * H + head) * (D_ + 2);
        dst[0] = sm.m[head];
        dst[1] = sm.l[head];
        std::copy(acc + head * D_, acc + (head + 1) * D_, dst + 2);
      }
    }
  }

  // The rows of one block segment (kv head 0; head h is h * head_dim further) and of the next.
  struct BlockRows {
    const KV* k;
    const KV* v;
    int n;
    int64_t token;  // the query token
    PrefetchStream* ahead;
  };

  // Heads head0..head0+gc-1 (sharing kv head h) over one block segment; scores go to s[g][t].
  void decode_general(const BlockRows& rows, int h, int head0, int gc, const float* qf, float* s,
                      OnlineSoftmax& sm) const {
    const int BS = a_.block_size;
    const KV* k = rows.k + h * D_;
    for (int t = 0; t < rows.n; ++t, k += row_)
      for (int g = 0; g < gc; ++g) s[g * BS + t] = dot(qf + (head0 + g) * D_, k, D_);
    for (int g = 0; g < gc; ++g) sm.update(head0 + g, s + g * BS, rows.n);
    const KV* v = rows.v + h * D_;
    for (int t = 0; t < rows.n; ++t, v += row_)
      for (int g = 0; g < gc; ++g) axpy(sm.acc + (head0 + g) * D_, s[g * BS + t], v, D_);
  }

  bool decode_fixed_dispatch(const BlockRows& rows, int h, int head0, int gc, const float* qf, float* s,
                             OnlineSoftmax& sm) const {
    constexpr int W = VecF::W;
    if constexpr (W >= 4) {
      if (D_ == 4 * W) return decode_fixed_gc<4>(rows, h, head0, gc, qf, s, sm);
      if (D_ == 8 * W) return decode_fixed_gc<8>(rows, h, head0, gc, qf, s, sm);
    }
    return false;
  }

  template <int DV>
  bool decode_fixed_gc(const BlockRows& rows, int h, int head0, int gc, const float* qf, float* s,
                       OnlineSoftmax& sm) const {
#if MINDIE_BF16_DOT
    // bf16 queries against bf16 keys: vdpbf16ps multiplies the raw pairs exactly and sums in
    // float32, the same arithmetic as converting first, with half the instructions.
    if constexpr (std::is_same_v<Q, bf16_t> && std::is_same_v<KV, bf16_t>) {
      if (cpu_has_avx512_bf16()) return decode_fixed_heads<DV, true>(rows, h, head0, gc, qf, s, sm);
    }
#endif
    return decode_fixed_heads<DV, false>(rows, h, head0, gc, qf, s, sm);
  }

  template <int DV, bool kBf16Dot>
  bool decode_fixed_heads(const BlockRows& rows, int h, int head0, int gc, const float* qf, float* s,
                          OnlineSoftmax& sm) const {
    switch (gc) {
      case 1: decode_fixed<1, DV, kBf16Dot>(rows, h, head0, qf, s, sm); return true;
      case 2: decode_fixed<2, DV, kBf16Dot>(rows, h, head0, qf, s, sm); return true;
      case 3: decode_fixed<3, DV, kBf16Dot>(rows, h, head0, qf, s, sm); return true;
      case 4: decode_fixed<4, DV, kBf16Dot>(rows, h, head0, qf, s, sm); return true;
      default: return false;
    }
  }

  // Walks the keys a group of kTokenGroup tokens at a time: token_dots(key_row, out) writes the GC
  // partial dot-product vectors of one key, and each group's W lane sums (kTokenGroup tokens x 4
  // heads) are reduced at once into st[t][4] (token-major). st must hold 4 * (n + kTokenGroup).
  template <typename TokenDots>
  void reduce_scores(const KV* k, int n, float* st, PrefetchStream& ahead, TokenDots&& token_dots) const {
    constexpr int W = VecF::W;
    // Only vector variants (W >= 4) reach this path; the clamp keeps the scalar build compiling.
    constexpr int kTokenGroup = W >= 4 ? W / 4 : 1;
    constexpr int kLanes = W >= 4 ? W : 4;
    for (int t0 = 0; t0 < n; t0 += kTokenGroup) {
      VecF p[kLanes];
      for (int i = 0; i < kLanes; ++i) p[i] = VecF::zero();
      for (int tg = 0; tg < kTokenGroup && t0 + tg < n; ++tg) {
        ahead.step();
        token_dots(k + (t0 + tg) * row_, p + tg * 4);
      }
      VecF::reduce_add_w(p, st + 4 * t0);
    }
  }

  // Scores of GC heads against n keys. The float path uses the pre-scaled float32 queries in qf;
  // the bf16 path the raw bf16 queries, scaled afterwards.
  template <int GC, int DV, bool kBf16Dot>
  void score_keys(const KV* k, int n, int head0, const float* qf, const int64_t token, float* st,
                  PrefetchStream& ahead) const {
    constexpr int W = VecF::W;
#if MINDIE_BF16_DOT
    if constexpr (kBf16Dot) {
      constexpr int DP = DV / 2;  // 32 bf16 per register
      const bf16_t* qb = reinterpret_cast<const bf16_t*>(q_) + token * a_.q_token_stride;
      __m512bh q[GC][DP];
      for (int g = 0; g < GC; ++g)
        for (int j = 0; j < DP; ++j) q[g][j] = (__m512bh)_mm512_loadu_si512(qb + (head0 + g) * D_ + j * 32);
      const __m512 scale = _mm512_set1_ps(a_.scale);
      reduce_scores(k, n, st, ahead, [&](const KV* kr, VecF* out) {
        __m512bh kb[DP];
        for (int j = 0; j < DP; ++j) kb[j] = (__m512bh)_mm512_loadu_si512(kr + j * 32);
        for (int g = 0; g < GC; ++g) {
          __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], kb[0]);
          for (int j = 1; j < DP; ++j) acc = _mm512_dpbf16_ps(acc, q[g][j], kb[j]);
          out[g] = VecF(_mm512_mul_ps(acc, scale));
        }
      });
      return;
    }
#endif
    (void)token;
    VecF q[GC][DV];
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < DV; ++j) q[g][j] = VecF::load(qf + (head0 + g) * D_ + j * W);
    reduce_scores(k, n, st, ahead, [&](const KV* kr, VecF* out) {
      VecF kv[DV];
      for (int j = 0; j < DV; ++j) kv[j] = VecF::load(kr + j * W);
      for (int g = 0; g < GC; ++g) {
        VecF p0 = q[g][0] * kv[0], p1 = q[g][1] * kv[1];
        for (int j = 2; j < DV; j += 2) {
          p0 = VecF::fma(q[g][j], kv[j], p0);
          p1 = VecF::fma(q[g][j + 1], kv[j + 1], p1);
        }
        out[g] = p0 + p1;
      }
    });
  }

  template <int GC, int DV, bool kBf16Dot>
  void decode_fixed(const BlockRows& rows, int h, int head0, const float* qf, float* s, OnlineSoftmax& sm) const {
    constexpr int W = VecF::W;
    const int BS = a_.block_size, n = rows.n;
    float* st = s + GC * BS;  // [BS][4]
    VecF acc[GC][DV];
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < DV; ++j) acc[g][j] = VecF::load(sm.acc + (head0 + g) * D_ + j * W);
    score_keys<GC, DV, kBf16Dot>(rows.k + h * D_, n, head0, qf, rows.token, st, *rows.ahead);
    for (int g = 0; g < GC; ++g)
      for (int t = 0; t < n; ++t) s[g * BS + t] = st[4 * t + g];
    for (int g = 0; g < GC; ++g) {
      const float m_old = sm.m[head0 + g];
      if (!sm.update_scores(head0 + g, s + g * BS, n)) continue;
      if (m_old != sm.m[head0 + g]) {
        const VecF alpha = VecF::set1(m_old == -INFINITY ? 0.f : std::exp(m_old - sm.m[head0 + g]));
        for (int j = 0; j < DV; ++j) acc[g][j] = acc[g][j] * alpha;
      }
    }
    const KV* v = rows.v + h * D_;
#if MINDIE_BF16_DOT
    if constexpr (kBf16Dot) {
      accumulate_values_bf16<GC, DV>(acc, v, n, s, reinterpret_cast<bf16_t*>(st), *rows.ahead);
    } else
#endif
    {
      for (int t = 0; t < n; ++t, v += row_) {
        rows.ahead->step();
        VecF vv[DV];
        for (int j = 0; j < DV; ++j) vv[j] = VecF::load(v + j * W);
        for (int g = 0; g < GC; ++g) {
          const VecF p = VecF::set1(s[g * BS + t]);
          for (int j = 0; j < DV; ++j) acc[g][j] = VecF::fma(p, vv[j], acc[g][j]);
        }
      }
    }
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < DV; ++j) acc[g][j].store(sm.acc + (head0 + g) * D_ + j * W);
  }

#if MINDIE_BF16_DOT
  // acc += P V with vdpbf16ps over pairs of tokens: the probabilities are rounded to bf16 (as a
  // bf16 Hugging Face model multiplies bf16 weights by bf16 values) and two value rows are
  // interleaved so each instruction adds p_t v_t + p_t+1 v_t+1. Interleaving permutes the head
  // dimension inside each register; the accumulators are permuted to match and back afterwards.
  template <int GC, int DV>
  void accumulate_values_bf16(VecF (&acc)[GC][DV], const KV* v, int n, const float* s, bf16_t* pb,
                              PrefetchStream& ahead) const {
    static_assert(DV % 2 == 0, "pairs of 16-lane accumulators hold 32 bf16 values");
    const int BS = a_.block_size, stride = BS + 2;
    for (int g = 0; g < GC; ++g) {
      store_scaled(pb + g * stride, s + g * BS, 1.f, n);
      pb[g * stride + n] = 0;  // the odd token's partner weighs nothing
    }
    const __m512i to_perm_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i to_perm_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i to_nat_0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i to_nat_1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < DV; j += 2) {
        const __m512 lo = _mm512_permutex2var_ps(acc[g][j].v, to_perm_lo, acc[g][j + 1].v);
        const __m512 hi = _mm512_permutex2var_ps(acc[g][j].v, to_perm_hi, acc[g][j + 1].v);
        acc[g][j] = VecF(lo);
        acc[g][j + 1] = VecF(hi);
      }
    for (int t = 0; t < n; t += 2) {
      const KV* r0 = v + t * row_;
      const KV* r1 = t + 1 < n ? r0 + row_ : r0;
      ahead.step();
      __m512bh lo[DV / 2], hi[DV / 2];
      for (int j = 0; j < DV / 2; ++j) {
        const __m512i x = _mm512_loadu_si512(r0 + j * 32), y = _mm512_loadu_si512(r1 + j * 32);
        lo[j] = (__m512bh)_mm512_unpacklo_epi16(x, y);
        hi[j] = (__m512bh)_mm512_unpackhi_epi16(x, y);
      }
      for (int g = 0; g < GC; ++g) {
        uint32_t pair;
        std::memcpy(&pair, pb + g * stride + t, sizeof pair);
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int j = 0; j < DV / 2; ++j) {
          acc[g][2 * j] = VecF(_mm512_dpbf16_ps(acc[g][2 * j].v, pp, lo[j]));
          acc[g][2 * j + 1] = VecF(_mm512_dpbf16_ps(acc[g][2 * j + 1].v, pp, hi[j]));
        }
      }
    }
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < DV; j += 2) {
        const __m512 n0 = _mm512_permutex2var_ps(acc[g][j].v, to_nat_0, acc[g][j + 1].v);
        const __m512 n1 = _mm512_permutex2var_ps(acc[g][j].v, to_nat_1, acc[g][j + 1].v);
        acc[g][j] = VecF(n0);
        acc[g][j + 1] = VecF(n1);
      }
  }
#endif

  void merge(const Merge& mg, int head) const {
    thread_local Scratch scratch;
    float* acc = scratch.get(D_);
    std::fill(acc, acc + D_, 0.f);
    float m = -INFINITY;
    for (int p = 0; p < mg.num_parts; ++p)
      m = std::max(m, workspace_[((mg.first_part + p) * a_.num_heads + head) * (D_ + 2)]);
    float l = 0.f;
    for (int p = 0; p < mg.num_parts; ++p) {
      const float* src = workspace_.data() + ((mg.first_part + p) * a_.num_heads + head) * (D_ + 2);
      if (src[0] == -INFINITY) continue;
      const float w = std::exp(src[0] - m);
      l += src[1] * w;
      axpy(acc, w, src + 2, D_);
    }
    store_output(a_.query_start_loc[mg.seq], head, acc, l > 0.f ? 1.f / l : 0.f);
  }

  // A tile of queries [w.begin, w.end) of one sequence: per key block, the block is converted once
  // to float32 (K transposed so scores vectorise over keys without horizontal sums), then every
  // query row of the tile is scored, masked causally, and accumulated.
  void prefill(const WorkItem& w) const {
    constexpr int W = VecF::W;
    thread_local Scratch scratch;
    const int G = group_, BS = a_.block_size;
    const int NP = (BS + W - 1) / W * W;  // padded keys per block
    const int rows = (w.end - w.begin) * G;
    float* qf = scratch.get(static_cast<size_t>(rows) * (2 * D_ + NP + 2) + static_cast<size_t>(D_) * NP * 2);
    float* acc = qf + rows * D_;
    float* s = acc + rows * D_;   // [rows][NP]
    float* ml = s + static_cast<int64_t>(rows) * NP;
    float* kt = ml + 2 * rows;    // [D][NP]
    float* vf = kt + static_cast<int64_t>(D_) * NP;  // [BS][D]
    OnlineSoftmax sm{ml, ml + rows, acc, D_};
    sm.init(rows);
    const int q_len = query_len(w.seq);
    const int first_pos = a_.seq_lens[w.seq] - q_len;  // position of query 0
    const int64_t token0 = a_.query_start_loc[w.seq] + w.begin;
    for (int i = w.begin; i < w.end; ++i) load_queries(qf + (i - w.begin) * G * D_, token0 + i - w.begin, w.kv_head);
    const int last_pos = first_pos + w.end - 1;
    for (int b0 = 0; b0 <= last_pos; b0 += BS) {
      const int n = std::min(BS, last_pos + 1 - b0);
      transpose_block(kt, NP, key_row(w.seq, b0, w.kv_head), n);
      const KV* v = value_row(w.seq, b0, w.kv_head);
      for (int t = 0; t < n; ++t, v += row_) load_scaled(vf + t * D_, v, 1.f, D_);
      // Queries before this block's first key see none of it. Rows (query i, head g) go kRowTile at
      // a time over the keys the tile's last row sees; a row's keys past its own position score
      // -inf, which the softmax turns into probabilities of exactly 0, so every row is computed as
      // it would be alone (its result never depends on the rows tiled with it).
      const int r_end = (w.end - w.begin) * G;
      for (int r0 = (std::max(w.begin, b0 - first_pos) - w.begin) * G; r0 < r_end; r0 += kRowTile) {
        const int rt = std::min(kRowTile, r_end - r0);
        const auto valid = [&](int r) { return std::min(n, first_pos + w.begin + r / G - b0 + 1); };
        const int vmax = valid(r0 + rt - 1);
        float* sr = s + static_cast<int64_t>(r0) * NP;
        score_rows(rt, sr, qf + r0 * D_, kt, NP, vmax);
        for (int r = r0; r < r0 + rt; ++r) {
          float* row = s + static_cast<int64_t>(r) * NP;
          std::fill(row + valid(r), row + vmax, -INFINITY);
          sm.update(r, row, vmax);  // a row sees at least its block's first key
        }
        accumulate_rows(rt, acc + r0 * D_, sr, NP, vf, vmax);
      }
    }
    for (int i = w.begin; i < w.end; ++i)
      for (int g = 0; g < G; ++g) {
        const int r = (i - w.begin) * G + g;
        store_output(token0 + i - w.begin, w.kv_head * G + g, acc + r * D_, sm.l[r] > 0.f ? 1.f / sm.l[r] : 0.f);
      }
  }

  // acc[r] += sum_t p[r][t] * vf[t] for rt rows (p rows NP apart), kAccVectors of the head dimension
  // at a time held in registers: each value vector loaded serves every row.
  void accumulate_rows(int rt, float* acc, const float* p, int NP, const float* vf, int valid) const {
    constexpr int W = VecF::W;
    if (D_ % (kAccVectors * W) != 0) {
      for (int r = 0; r < rt; ++r)
        for (int t = 0; t < valid; ++t) axpy(acc + r * D_, p[r * NP + t], vf + t * D_, D_);
      return;
    }
    with_rows(rt, [&](auto rows) { accumulate_rows_fixed<decltype(rows)::value>(acc, p, NP, vf, valid); });
  }

  // f(std::integral_constant<int, rt>) for a row tile of rt = 1..4 rows.
  template <typename F>
  static void with_rows(int rt, F&& f) {
    static_assert(kRowTile <= 4, "with_rows instantiates tiles of up to 4 rows");
    switch (rt) {
      case 4: return f(std::integral_constant<int, 4>{});
      case 3: return f(std::integral_constant<int, 3>{});
      case 2: return f(std::integral_constant<int, 2>{});
      default: return f(std::integral_constant<int, 1>{});
    }
  }

  template <int RT>
  void accumulate_rows_fixed(float* acc, const float* p, int NP, const float* vf, int valid) const {
    constexpr int W = VecF::W;
    for (int j0 = 0; j0 < D_; j0 += kAccVectors * W) {
      VecF a[RT][kAccVectors];
      for (int r = 0; r < RT; ++r)
        for (int j = 0; j < kAccVectors; ++j) a[r][j] = VecF::load(acc + r * D_ + j0 + j * W);
      for (int t = 0; t < valid; ++t) {
        VecF v[kAccVectors];
        for (int j = 0; j < kAccVectors; ++j) v[j] = VecF::load(vf + t * D_ + j0 + j * W);
        for (int r = 0; r < RT; ++r) {
          const VecF pt = VecF::set1(p[r * NP + t]);
          for (int j = 0; j < kAccVectors; ++j) a[r][j] = VecF::fma(pt, v[j], a[r][j]);
        }
      }
      for (int r = 0; r < RT; ++r)
        for (int j = 0; j < kAccVectors; ++j) a[r][j].store(acc + r * D_ + j0 + j * W);
    }
  }

  // kt[d][t] = float(k[t][d]) for t < n; zero for the padding up to NP.
  void transpose_block(float* kt, int NP, const KV* k, int n) const {
    for (int t = 0; t < n; ++t, k += row_)
      for (int d = 0; d < D_; ++d) kt[d * NP + t] = to_float(k[d]);
    for (int d = 0; d < D_; ++d) std::fill(kt + d * NP + n, kt + (d + 1) * NP, 0.f);
  }

  static float to_float(float x) { return x; }
  static float to_float(bf16_t x) { return bf16_to_float(x); }

  // s[r][t] = q[r] . k_t for rt rows (s rows NP apart, q rows D apart) and t < valid, rounded up to
  // whole vectors of keys, up to 4 vectors at a time: each key vector loaded serves every row.
  void score_rows(int rt, float* s, const float* q, const float* kt, int NP, int valid) const {
    with_rows(rt, [&](auto rows) { score_rows_fixed<decltype(rows)::value>(s, q, kt, NP, valid); });
  }

  template <int RT>
  void score_rows_fixed(float* s, const float* q, const float* kt, int NP, int valid) const {
    constexpr int W = VecF::W;
    const int nv = (valid + W - 1) / W;
    int c = 0;
    for (; c + 4 <= nv; c += 4) score_chunk<RT, 4>(s, q, kt, NP, c * W);
    switch (nv - c) {
      case 3: score_chunk<RT, 3>(s, q, kt, NP, c * W); break;
      case 2: score_chunk<RT, 2>(s, q, kt, NP, c * W); break;
      case 1: score_chunk<RT, 1>(s, q, kt, NP, c * W); break;
      default: break;
    }
  }

  template <int RT, int NV>
  void score_chunk(float* s, const float* q, const float* kt, int NP, int t0) const {
    constexpr int W = VecF::W;
    VecF acc[RT][NV];
    for (int r = 0; r < RT; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = VecF::zero();
    for (int d = 0; d < D_; ++d) {
      const float* row = kt + static_cast<int64_t>(d) * NP + t0;
      VecF k[NV];
      for (int j = 0; j < NV; ++j) k[j] = VecF::load(row + j * W);
      for (int r = 0; r < RT; ++r) {
        const VecF qd = VecF::set1(q[r * D_ + d]);
        for (int j = 0; j < NV; ++j) acc[r][j] = VecF::fma(qd, k[j], acc[r][j]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j].store(s + r * NP + t0 + j * W);
  }

  const PagedAttentionArgs& a_;
  const Q* q_;
  const KV* kc_;
  const KV* vc_;
  Q* out_;
  const int group_;
  const int D_;
  const int64_t row_;
  std::vector<WorkItem> work_;
  std::vector<Merge> merges_;
  int64_t num_parts_ = 0;
  mutable std::vector<float> workspace_;
};

}  // namespace

void paged_attention(const PagedAttentionArgs& a) {
  const bool q32 = a.q_dtype == DType::kFloat32, kv32 = a.kv_dtype == DType::kFloat32;
  if (q32 && kv32) Attention<float, float>(a).run();
  else if (q32) Attention<float, bf16_t>(a).run();
  else if (kv32) Attention<bf16_t, float>(a).run();
  else Attention<bf16_t, bf16_t>(a).run();
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
