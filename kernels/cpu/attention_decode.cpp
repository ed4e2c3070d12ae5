// The decode phase of paged attention: one token's heads over a range of its keys, a cache block at a
// time, and the merge of a context's split partial results.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu/attention_common.h"
#include "cpu/dispatch.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

// Key-row bytes a decode segment covers (Decode::decode).
constexpr int64_t kSegmentBytes = 32 << 10;

// Issues prefetches for the K then V rows of a block (`tokens` rows `stride` bytes apart, the first
// `span` bytes of each: the item's kv heads), a few cache lines per step(), so the whole block has
// been asked for after `steps` calls.
class PrefetchStream {
 public:
  PrefetchStream(const void* k, const void* v, int64_t tokens, int64_t stride, int64_t span, int64_t steps)
      : at_(static_cast<const char*>(k)), v_(static_cast<const char*>(v)), span_((span + 63) / 64 * 64),
        skip_(stride - span_), row_end_(tokens > 0 ? at_ + span_ : at_), tokens_(tokens), rows_left_(tokens),
        per_step_(steps > 0 ? (2 * tokens * (span_ / 64) + steps - 1) / steps : 0), which_(tokens > 0 ? 0 : 2) {}
  // Pointers only, no multiply a line: stepped beside every key and value, row and line counters
  // (token * stride + line * 64) took about as many instructions as the dot products between them.
  void step() {
    for (int64_t i = 0; i < per_step_ && which_ < 2; ++i) {
      __builtin_prefetch(at_, 0, 3);
      at_ += 64;
      if (at_ < row_end_) continue;
      if (--rows_left_ > 0) {
        at_ += skip_;
      } else {
        if (++which_ == 2) break;
        at_ = v_;
        rows_left_ = tokens_;
      }
      row_end_ = at_ + span_;
    }
  }

 private:
  const char* at_;  // the next line to ask for
  const char* v_;   // the block's first V row
  int64_t span_;    // the bytes asked for of each row, in whole lines
  int64_t skip_;    // from the end of a row's span to the start of the next row's
  const char* row_end_;
  int64_t tokens_;
  int64_t rows_left_;  // rows of the current half (K, then V), this one included
  int64_t per_step_;
  int which_;  // 0: K, 1: V, 2: done
};

// The prefetches stepped beside one block's iterations: the next block's rows, spread over all of
// them, and, at an item's first block, which no block before it asked for, the block's own rows over
// its first `n` steps (the first heads' pass over the keys: two rows a step, so the keys run ahead of
// the reads and the values are in cache before their pass). Without them those rows, a cache row
// (every kv head) apart, came one demand miss at a time. On a 2-core Zen 5, Llama-3.2-3B Q4_K_M
// decode steps, interleaved runs: 32 contexts of 128-168 tokens (1-2 blocks each, so every block is
// a first one) 326-330 -> 304-306 ms; one of 2048 tokens (split into parts of 256 keys, each starting
// cold) 56.3-57.0 -> 52.9-53.0 ms; 8 contexts 90.8-91.4 -> 88.5-89.4 ms.
struct BlockPrefetches {
  PrefetchStream own, next;
  void step() {
    own.step();
    next.step();
  }
};

template <typename Q, typename KV>
class Decode : AttentionView<Q, KV> {
  using Base = AttentionView<Q, KV>;
  using Base::a_, Base::q_, Base::group_, Base::D_, Base::row_, Base::key_row, Base::value_row, Base::store_output;

 public:
  explicit Decode(const Base& view) : Base(view) {}

  // One token's queries of kv heads [w.kv_head, w.kv_head_end) against keys [w.begin, w.end), a
  // block at a time and, within a block, a kv head at a time: scores, online-softmax update, then
  // the weighted values. Head dims that fill whole vectors keep queries and accumulators in
  // registers (decode_fixed).
  void decode(const WorkItem& w, float* workspace) const {
    thread_local Scratch scratch;
    const int H = a_.num_heads, BS = a_.block_size, G = group_;
    const int head_begin = w.kv_head * G, head_end = w.kv_head_end * G;
    // s: [max(G, 4)][BS] scores (a kv head's group, or decode_fixed's up to 4 heads), then its
    // [BS + 16][4] reduced sums; decode_rows's [H][BS] scores, then its [BS][H + W] reduced sums.
    const size_t score_floats = static_cast<size_t>(std::max({G, 4, H})) * BS + static_cast<size_t>(BS + 16) * (H + 16);
    float* qf = scratch.get(static_cast<size_t>(H) * (2 * D_ + 2) + score_floats + 64);
    float* acc = qf + H * D_;
    float* ml = acc + H * D_;
    float* s = ml + 2 * H;
    OnlineSoftmax sm{ml, ml + H, acc, D_, a_.softcap};
    sm.init(H);
    const int64_t token = a_.query_start_loc[w.seq];
    load_scaled(qf + head_begin * D_, q_ + token * a_.q_token_stride + head_begin * D_, a_.scale,
                (head_end - head_begin) * D_);
    // Head dims that fill whole vectors take the item's heads a kv head's group at a time where
    // that is 2 to 4 heads (the group reads its key and value slices once for all of them),
    // otherwise four at a time whatever their kv heads (with one query per kv head, four kv heads'
    // slices are read side by side), or, with one or two queries per kv head and no native bf16
    // dot products, whole cache rows at a time (decode_rows, whose front-to-back reads the
    // hardware prefetcher follows without the software prefetches); the general path one kv
    // head's group at a time.
    const bool fixed = fixed_head_dim(), by_rows = fixed && !bf16_dot() && G <= 2;
    const int heads_per_call = G >= 2 && G <= 4 ? G : 4;
    const int kv_heads = w.kv_head_end - w.kv_head;
    const int calls = fixed ? (head_end - head_begin + heads_per_call - 1) / heads_per_call : kv_heads * ((G + 3) / 4);
    const int64_t stride = row_ * static_cast<int64_t>(sizeof(KV));
    const int64_t span = int64_t{kv_heads} * D_ * static_cast<int64_t>(sizeof(KV));
    // The walk down the keys and values a segment at a time: a block, or where the fixed paths walk
    // slices a cache row apart, kSegmentBytes of key rows, so that the segment's lines stay in L1
    // between the passes of its heads (rows 4 KB apart fall into the same L1 sets) and the next
    // segment's prefetches run right behind. On a 2-core Zen 5, bf16 caches of Llama-3.2-3B's 24/8
    // heads of 128, 32 contexts of 192 tokens: 25 -> 30-31 GB/s with float32 queries (the model
    // step's), 28.5 -> 35-37 with bf16 ones; one 4096-token context 29-31 -> 40 (bf16 queries; all
    // with the other changes of that commit).
    const int segment = by_rows || !fixed ? BS : std::clamp(static_cast<int>(kSegmentBytes / stride) / 4 * 4, 4, BS);
    const auto segment_end = [&](int b) { return std::min({w.end, (b / BS + 1) * BS, b + segment}); };
    for (int b0 = w.begin; b0 < w.end;) {
      const int n = segment_end(b0) - b0;
      const int next = b0 + n;
      const int n_next = next < w.end ? segment_end(next) - next : 0;
      // While this segment is computed, the next one streams into cache: blocks are scattered, so
      // the hardware prefetcher would restart at each one. Spread over the segment's iterations (and
      // an item's first segment over its own first ones: BlockPrefetches).
      const bool own = b0 == w.begin && !by_rows;
      BlockPrefetches ahead{
          PrefetchStream(key_row(w.seq, b0, w.kv_head), value_row(w.seq, b0, w.kv_head), own ? n : 0, stride, span, n),
          PrefetchStream(n_next > 0 ? key_row(w.seq, next, w.kv_head) : nullptr,
                         n_next > 0 ? value_row(w.seq, next, w.kv_head) : nullptr, n_next, stride, span,
                         by_rows ? 0 : calls * (n + (n + 1) / 2))};
      const BlockRows rows{key_row(w.seq, b0, 0), value_row(w.seq, b0, 0), n, token, &ahead};
      if (by_rows) {
        with_head_vectors([&](auto dv) { decode_rows<decltype(dv)::value>(rows, head_begin, head_end, qf, s, sm); });
      } else if (fixed) {
        with_head_vectors([&](auto dv) {
          for (int head0 = head_begin; head0 < head_end; head0 += heads_per_call)
            decode_fixed_gc<decltype(dv)::value>(rows, head0, std::min(heads_per_call, head_end - head0), qf, s, sm);
        });
      } else {
        for (int h = w.kv_head; h < w.kv_head_end; ++h)
          for (int g0 = 0; g0 < G; g0 += 4) decode_general(rows, h, h * G + g0, std::min(4, G - g0), qf, s, sm);
      }
      b0 += n;
    }
    for (int head = head_begin; head < head_end; ++head) {
      if (w.part < 0) {
        store_output(token, head, acc + head * D_, sm.l[head] > 0.f ? 1.f / sm.l[head] : 0.f);
      } else {
        float* dst = workspace + (w.part * H + head) * (D_ + 2);
        dst[0] = sm.m[head];
        dst[1] = sm.l[head];
        std::copy(acc + head * D_, acc + (head + 1) * D_, dst + 2);
      }
    }
  }

  void merge(const Merge& mg, int head, const float* workspace) const {
    thread_local Scratch scratch;
    float* acc = scratch.get(D_);
    std::fill(acc, acc + D_, 0.f);
    float m = -INFINITY;
    for (int p = 0; p < mg.num_parts; ++p)
      m = std::max(m, workspace[((mg.first_part + p) * a_.num_heads + head) * (D_ + 2)]);
    float l = 0.f;
    for (int p = 0; p < mg.num_parts; ++p) {
      const float* src = workspace + ((mg.first_part + p) * a_.num_heads + head) * (D_ + 2);
      if (src[0] == -INFINITY) continue;
      const float w = std::exp(src[0] - m);
      l += src[1] * w;
      axpy(acc, w, src + 2, D_);
    }
    store_output(a_.query_start_loc[mg.seq], head, acc, l > 0.f ? 1.f / l : 0.f);
  }

 private:
  // The rows of one block segment (kv head 0; head h is h * head_dim further) and of the next.
  struct BlockRows {
    const KV* k;
    const KV* v;
    int n;
    int64_t token;  // the query token
    BlockPrefetches* ahead;
  };

  // Heads head0..head0+gc-1 (sharing kv head h) over one block segment; scores go to s[g][t]. Steps
  // the prefetches once a key and once a value, as the fixed paths do. Head dim 128 takes this path
  // in the AVX2 variant (16 vectors of 8), and without the steps it read every block one demand miss
  // at a time: Llama-3.2-3B Q4_K_M (`MINDIE_ISA=avx2` on a 2-core Zen 5, one build choosing by an
  // environment variable, processes interleaved) at one 2048-token context 71.9-80.1 -> 57.3-61.9 ms
  // a decode step, at 32 contexts of 128-152 tokens 571-580 -> 564-568 ms.
  void decode_general(const BlockRows& rows, int h, int head0, int gc, const float* qf, float* s,
                      OnlineSoftmax& sm) const {
    const int BS = a_.block_size;
    BlockPrefetches ahead = *rows.ahead;  // as in reduce_scores
    const KV* k = rows.k + h * D_;
    for (int t = 0; t < rows.n; ++t, k += row_) {
      ahead.step();
      for (int g = 0; g < gc; ++g) s[g * BS + t] = dot(qf + (head0 + g) * D_, k, D_);
    }
    for (int g = 0; g < gc; ++g) sm.update(head0 + g, s + g * BS, rows.n);
    const KV* v = rows.v + h * D_;
    for (int t = 0; t < rows.n; ++t, v += row_) {
      ahead.step();
      for (int g = 0; g < gc; ++g) axpy(sm.acc + (head0 + g) * D_, s[g * BS + t], v, D_);
    }
    *rows.ahead = ahead;
  }

  bool fixed_head_dim() const {
    constexpr int W = VecF::W;
    return W >= 4 && (D_ == 4 * W || D_ == 8 * W);
  }

  // Whether decode_fixed multiplies with vdpbf16ps (bf16 queries and keys, native bf16 dot products).
  bool bf16_dot() const {
#if MINDIE_BF16_DOT
    if constexpr (std::is_same_v<Q, bf16_t> && std::is_same_v<KV, bf16_t>) return cpu_has_avx512_bf16();
#endif
    return false;
  }

  // f(std::integral_constant<int, DV>{}) with DV the vectors a head's row fills, when fixed_head_dim().
  template <class F>
  void with_head_vectors(F&& f) const {
    constexpr int W = VecF::W;
    if constexpr (W >= 4) {
      if (D_ == 4 * W) f(std::integral_constant<int, 4>{});
      else f(std::integral_constant<int, 8>{});
    }
  }

  // Every head of [head_begin, head_end) over one block segment, a whole cache row at a time: each
  // key's scores for all the heads, then the softmax, then each value row into every head's
  // accumulator (in sm.acc, not registers). The rows are read front to back, which the hardware
  // prefetcher follows. decode_fixed walks a few heads' slices down the block instead (rows a cache
  // row apart), which leaves the reads to the software prefetches, and those keep only about 16
  // lines in flight on a core: one Sapphire Rapids core read a 32-kv-head bf16 cache at 8.7 GB/s
  // that way, 11.7 this way. With more queries per kv head, decode_fixed's accumulators in
  // registers win back more than that. A head's arithmetic is decode_fixed's, in the same order.
  template <int DV>
  void decode_rows(const BlockRows& rows, int head_begin, int head_end, const float* qf, float* s,
                   OnlineSoftmax& sm) const {
    constexpr int W = VecF::W;
    const int BS = a_.block_size, n = rows.n, heads = head_end - head_begin;
    const int padded = (heads + W - 1) / W * W;
    float* st = s + static_cast<int64_t>(heads) * BS;  // [n][padded]
    for (int t = 0; t < n; ++t) {
      const KV* kr = rows.k + t * row_;
      float* out = st + t * padded;
      VecF p[W];
      int i = 0;
      for (int head = head_begin; head < head_end;) {
        const KV* k = kr + (head / group_) * D_;
        VecF kv[DV];
        for (int j = 0; j < DV; ++j) kv[j] = VecF::load(k + j * W);
        // The heads that share this kv head: its row slice is loaded once for all of them.
        for (const int end = std::min(head_end, (head / group_ + 1) * group_); head < end; ++head) {
          const float* q = qf + head * D_;
          VecF p0 = VecF::load(q) * kv[0], p1 = VecF::load(q + W) * kv[1];
          for (int j = 2; j < DV; j += 2) {
            p0 = VecF::fma(VecF::load(q + j * W), kv[j], p0);
            p1 = VecF::fma(VecF::load(q + (j + 1) * W), kv[j + 1], p1);
          }
          p[i++] = p0 + p1;
          if (i == W || head + 1 == head_end) {
            for (; i < W; ++i) p[i] = VecF::zero();
            VecF::reduce_add_w(p, out);
            out += W;
            i = 0;
          }
        }
      }
    }
    for (int h = 0; h < heads; ++h) {
      float* sh = s + h * BS;
      for (int t = 0; t < n; ++t) sh[t] = st[t * padded + h];
      sm.update(head_begin + h, sh, n);
    }
    for (int t = 0; t < n; ++t) {
      const KV* vr = rows.v + t * row_;
      for (int head = head_begin; head < head_end;) {
        const KV* v = vr + (head / group_) * D_;
        VecF vv[DV];
        for (int j = 0; j < DV; ++j) vv[j] = VecF::load(v + j * W);
        // The heads that share this kv head: its row slice is loaded once for all of them.
        for (const int end = std::min(head_end, (head / group_ + 1) * group_); head < end; ++head) {
          float* a = sm.acc + head * D_;
          const VecF pt = VecF::set1(s[(head - head_begin) * BS + t]);
          for (int j = 0; j < DV; ++j) VecF::fma(pt, vv[j], VecF::load(a + j * W)).store(a + j * W);
        }
      }
    }
  }

  // Heads head0..head0+gc-1 (gc <= 4), when fixed_head_dim().
  template <int DV>
  void decode_fixed_gc(const BlockRows& rows, int head0, int gc, const float* qf, float* s, OnlineSoftmax& sm) const {
#if MINDIE_BF16_DOT
    // bf16 queries against bf16 keys: vdpbf16ps multiplies the raw pairs exactly and sums in
    // float32, the same arithmetic as converting first, with half the instructions.
    if constexpr (std::is_same_v<Q, bf16_t> && std::is_same_v<KV, bf16_t>) {
      if (bf16_dot()) return decode_fixed_heads<DV, true>(rows, head0, gc, qf, s, sm);
    }
#endif
    decode_fixed_heads<DV, false>(rows, head0, gc, qf, s, sm);
  }

  template <int DV, bool kBf16Dot>
  void decode_fixed_heads(const BlockRows& rows, int head0, int gc, const float* qf, float* s, OnlineSoftmax& sm) const {
    // Heads of one kv head read its rows once for all of them.
    if ((head0 + gc - 1) / group_ == head0 / group_) return decode_fixed_count<DV, kBf16Dot, true>(rows, head0, gc, qf, s, sm);
    decode_fixed_count<DV, kBf16Dot, false>(rows, head0, gc, qf, s, sm);
  }

  template <int DV, bool kBf16Dot, bool kShared>
  void decode_fixed_count(const BlockRows& rows, int head0, int gc, const float* qf, float* s, OnlineSoftmax& sm) const {
    switch (gc) {
      case 1: return decode_fixed<1, DV, kBf16Dot, true>(rows, head0, qf, s, sm);
      case 2: return decode_fixed<2, DV, kBf16Dot, kShared>(rows, head0, qf, s, sm);
      case 3: return decode_fixed<3, DV, kBf16Dot, kShared>(rows, head0, qf, s, sm);
      default: return decode_fixed<4, DV, kBf16Dot, kShared>(rows, head0, qf, s, sm);
    }
  }

  // Element offsets of heads head0..head0+GC-1's kv rows from the first one's, within a token row.
  template <int GC>
  void kv_offsets(int head0, int (&off)[GC]) const {
    for (int g = 0; g < GC; ++g) off[g] = ((head0 + g) / group_ - head0 / group_) * D_;
  }

  // Walks the keys a group of kTokenGroup tokens at a time: token_dots(key_row, out) writes the GC
  // partial dot-product vectors of one key, and each group's W lane sums (kTokenGroup tokens x 4
  // heads) are reduced at once into st[t][4] (token-major). st must hold 4 * (n + kTokenGroup).
  template <typename TokenDots>
  void reduce_scores(const KV* k, int n, float* st, BlockPrefetches& prefetches, TokenDots&& token_dots) const {
    BlockPrefetches ahead = prefetches;  // a local copy, whose fields stay in registers through the loop
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
    prefetches = ahead;
  }

  // Scores of GC heads against n keys. The float path uses the pre-scaled float32 queries in qf;
  // the bf16 path the raw bf16 queries, scaled afterwards.
  template <int GC, int DV, bool kBf16Dot, bool kShared>
  void score_keys(const KV* k, int n, int head0, const float* qf, const int64_t token, float* st,
                  BlockPrefetches& ahead) const {
    constexpr int W = VecF::W;
    int off[GC];
    kv_offsets<GC>(head0, off);
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
        for (int g = 0; g < GC; ++g) {
          if (g == 0 || !kShared)
            for (int j = 0; j < DP; ++j) kb[j] = (__m512bh)_mm512_loadu_si512(kr + off[g] + j * 32);
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
      for (int g = 0; g < GC; ++g) {
        if (g == 0 || !kShared)
          for (int j = 0; j < DV; ++j) kv[j] = VecF::load(kr + off[g] + j * W);
        VecF p0 = q[g][0] * kv[0], p1 = q[g][1] * kv[1];
        for (int j = 2; j < DV; j += 2) {
          p0 = VecF::fma(q[g][j], kv[j], p0);
          p1 = VecF::fma(q[g][j + 1], kv[j + 1], p1);
        }
        out[g] = p0 + p1;
      }
    });
  }

  // Heads head0..head0+GC-1 over one block segment; kShared: all of one kv head.
  template <int GC, int DV, bool kBf16Dot, bool kShared>
  void decode_fixed(const BlockRows& rows, int head0, const float* qf, float* s, OnlineSoftmax& sm) const {
    constexpr int W = VecF::W;
    const int BS = a_.block_size, n = rows.n;
    float* st = s + GC * BS;  // [BS][4]
    const int64_t kv0 = static_cast<int64_t>(head0 / group_) * D_;
    score_keys<GC, DV, kBf16Dot, kShared>(rows.k + kv0, n, head0, qf, rows.token, st, *rows.ahead);
    for (int g = 0; g < GC; ++g)
      for (int t = 0; t < n; ++t) s[g * BS + t] = st[4 * t + g];
    // Loaded after the scores, which do not need them: 32 registers of accumulators (4 heads of
    // 128) live across the key pass left its queries and keys to the stack.
    VecF acc[GC][DV];
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < DV; ++j) acc[g][j] = VecF::load(sm.acc + (head0 + g) * D_ + j * W);
    for (int g = 0; g < GC; ++g) {
      const float m_old = sm.m[head0 + g];
      if (!sm.update_scores(head0 + g, s + g * BS, n)) continue;
      if (m_old != sm.m[head0 + g]) {
        const VecF alpha = VecF::set1(m_old == -INFINITY ? 0.f : std::exp(m_old - sm.m[head0 + g]));
        for (int j = 0; j < DV; ++j) acc[g][j] = acc[g][j] * alpha;
      }
    }
    const KV* v = rows.v + kv0;
    int off[GC];
    kv_offsets<GC>(head0, off);
#if MINDIE_BF16_DOT
    if constexpr (kBf16Dot) {
      accumulate_values_bf16<GC, DV, kShared>(acc, v, off, n, s, reinterpret_cast<bf16_t*>(st), *rows.ahead);
    } else
#endif
    {
      BlockPrefetches ahead = *rows.ahead;  // as in reduce_scores
      for (int t = 0; t < n; ++t, v += row_) {
        ahead.step();
        VecF vv[DV];
        for (int g = 0; g < GC; ++g) {
          if (g == 0 || !kShared)
            for (int j = 0; j < DV; ++j) vv[j] = VecF::load(v + off[g] + j * W);
          const VecF p = VecF::set1(s[g * BS + t]);
          for (int j = 0; j < DV; ++j) acc[g][j] = VecF::fma(p, vv[j], acc[g][j]);
        }
      }
      *rows.ahead = ahead;
    }
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < DV; ++j) acc[g][j].store(sm.acc + (head0 + g) * D_ + j * W);
  }

#if MINDIE_BF16_DOT
  // acc += P V with vdpbf16ps over pairs of tokens: the probabilities are rounded to bf16 (as a
  // bf16 Hugging Face model multiplies bf16 weights by bf16 values) and two value rows are
  // interleaved so each instruction adds p_t v_t + p_t+1 v_t+1. Interleaving permutes the head
  // dimension inside each register; the accumulators are permuted to match and back afterwards.
  template <int GC, int DV, bool kShared>
  void accumulate_values_bf16(VecF (&acc)[GC][DV], const KV* v, const int (&off)[GC], int n, const float* s,
                              bf16_t* pb, BlockPrefetches& prefetches) const {
    BlockPrefetches ahead = prefetches;  // as in reduce_scores
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
      for (int g = 0; g < GC; ++g) {
        if (g == 0 || !kShared)
          for (int j = 0; j < DV / 2; ++j) {
            const __m512i x = _mm512_loadu_si512(r0 + off[g] + j * 32), y = _mm512_loadu_si512(r1 + off[g] + j * 32);
            lo[j] = (__m512bh)_mm512_unpacklo_epi16(x, y);
            hi[j] = (__m512bh)_mm512_unpackhi_epi16(x, y);
          }
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
    prefetches = ahead;
  }
#endif
};

}  // namespace

template <typename Q, typename KV>
void decode_range(const AttentionView<Q, KV>& view, const WorkItem& w, float* workspace) {
  Decode<Q, KV>(view).decode(w, workspace);
}

template <typename Q, typename KV>
void merge_splits(const AttentionView<Q, KV>& view, const Merge& mg, int head, const float* workspace) {
  Decode<Q, KV>(view).merge(mg, head, workspace);
}

template void decode_range(const AttentionView<float, float>&, const WorkItem&, float*);
template void decode_range(const AttentionView<float, bf16_t>&, const WorkItem&, float*);
template void decode_range(const AttentionView<bf16_t, float>&, const WorkItem&, float*);
template void decode_range(const AttentionView<bf16_t, bf16_t>&, const WorkItem&, float*);
template void merge_splits(const AttentionView<float, float>&, const Merge&, int, const float*);
template void merge_splits(const AttentionView<float, bf16_t>&, const Merge&, int, const float*);
template void merge_splits(const AttentionView<bf16_t, float>&, const Merge&, int, const float*);
template void merge_splits(const AttentionView<bf16_t, bf16_t>&, const Merge&, int, const float*);

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
