// Integer matmul over block-quantized weights (see quant.h). Work is split over the threads as
// contiguous ranges of 16-row panels. Each panel is staged once into a small buffer in the panel
// layout (rows side by side, see vec_int8.h) and applied to every activation row, a register tile
// at a time. The result of an output element depends only on its weight row and activation row: the
// tile shape, the number of activation rows and the thread split decide where it is computed, never
// how (Int8Panel::tile reduces each element in one lane, in one fixed order). With few activation
// rows (decode), matrices packed in panels (quant.h) are instead read where they lie
// (Int8Panel::stream), to the same sums in the same order.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/dispatch.h"
#include "cpu/parallel.h"
#include "cpu/quant.h"
#include "cpu/vec_amx.h"
#include "cpu/vec_int8.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

// Sixteen rows read side by side are sixteen streams, which the hardware prefetcher picks up late
// (at every matrix start, and again and again in small ones). A thread asks for its first panels
// at once; staging a panel then prefetches, block by block, the panel it stages next.
int64_t panel_bytes(const QMatrix& w, int64_t row0) {
  return (w.panels ? kPanelRows : std::min<int64_t>(kPanelRows, w.rows - row0)) * w.row_bytes;
}

// stage(format, panel, blocks, b) for each block b in [b0, b1) (default: all) of w's panel at row0 (a
// matrix in the row layout packed into `packed` first), prefetching the same blocks of `next`, a
// packed panel of the same shape, block by block.
template <class StageBlock>
void walk_panel_blocks(const QMatrix& w, int64_t row0, const uint8_t* next, std::vector<uint8_t>& packed,
                       StageBlock&& stage, int64_t b0 = 0, int64_t b1 = -1) {
  const int64_t blocks = w.cols / 32;
  if (b1 < 0) b1 = blocks;
  const uint8_t* panel = w.data + row0 * w.row_bytes;
  if (!w.panels) {
    packed.resize(kPanelRows * w.row_bytes);
    pack_panels({panel, std::min<int64_t>(kPanelRows, w.rows - row0), w.cols, w.row_bytes, w.format}, packed.data());
    panel = packed.data();
  }
  const int64_t step = (panel_bytes(w, row0) / blocks + 63) / 64 * 64;
  with_format(w.format, [&](auto format) {
    for (int64_t b = b0; b < b1; ++b) {
      if (next != nullptr)
        for (int64_t off = b * step; off < (b + 1) * step; off += 64) __builtin_prefetch(next + off);
      stage(format, panel, blocks, b);
    }
  });
}

// One panel staged for D's tile (D::stage_block), straight from its blocks.
template <class D>
struct PanelBuffer {
  using Weight = typename D::Weight;
  std::vector<uint8_t> packed;
  ScratchVector<Weight> q_buffer;
  ScratchVector<float> scale_buffer, offset_buffer;
  Weight* q = nullptr;
  float* scale = nullptr;
  float* offset = nullptr;

  void stage(const QMatrix& w, int64_t row0, const uint8_t* next) {
    const int64_t groups = w.cols / 16;
    q = sized(q_buffer, groups * kPanelGroupValues);
    scale = sized(scale_buffer, groups * kPanelRows);
    offset = sized(offset_buffer, groups * kPanelRows);
    walk_panel_blocks(w, row0, next, packed, [&](auto format, const uint8_t* panel, int64_t blocks, int64_t b) {
      D::template stage_block<decltype(format)::value>(panel, blocks, b, q, scale, offset);
    });
  }
  StagedPanel<Weight> ref() const { return {q, scale, offset}; }
};

// One panel staged as B's bf16 panel (B::stage_block), straight from its blocks: all of them, or
// 32-value blocks [b0, b1) (a k-chunk), prefetching the same blocks of `next`.
template <class B>
struct Bf16PanelBuffer {
  std::vector<uint8_t> packed;
  ScratchVector<bf16_t> values;
  const bf16_t* data = nullptr;

  void stage(const QMatrix& w, int64_t row0, const uint8_t* next) { stage_blocks(w, row0, next, 0, w.cols / 32); }
  void stage_blocks(const QMatrix& w, int64_t row0, const uint8_t* next, int64_t b0, int64_t b1) {
    bf16_t* out = sized(values, (b1 - b0) * 2 * kBf16PanelGroupElems);
    walk_panel_blocks(w, row0, next, packed, [&](auto format, const uint8_t* panel, int64_t blocks, int64_t b) {
      B::template stage_block<decltype(format)::value>(panel, blocks, b, out + 2 * (b - b0) * kBf16PanelGroupElems);
    }, b0, b1);
    data = out;
  }
};

// The same staged a k-chunk at a time: stage() only notes where the panel lies (for
// for_each_panel_group), stage_chunk() stages blocks [b0, b1), and where they are all of k prefetches
// the panel staged after it (for_each_panel_group's `next`) meanwhile.
template <class B>
struct Bf16ChunkBuffer : Bf16PanelBuffer<B> {
  const QMatrix* w = nullptr;
  int64_t row0 = 0;
  const uint8_t* next = nullptr;

  void stage(const QMatrix& matrix, int64_t r0, const uint8_t* next_panel) {
    w = &matrix;
    row0 = r0;
    next = next_panel;
  }
  void stage_chunk(int64_t b0, int64_t b1) {
    const bool whole = b0 == 0 && b1 == w->cols / 32;
    this->stage_blocks(*w, row0, whole ? next : nullptr, b0, b1);
  }
};

void prefetch_panel(const QMatrix& w, int64_t row0) {
  const uint8_t* at = w.data + row0 * w.row_bytes;
  for (int64_t off = 0; off < panel_bytes(w, row0); off += 64) __builtin_prefetch(at + off);
}

struct Panel {
  const QMatmulTarget* target;
  int64_t row0;
  int call = 0;  // which of a batch's calls (qmatmul_batch) the target belongs to
};

// out[(r * cols + c) * 16 + lane] for panels p[0..panels) and activation rows c0.. (bias added) to the
// targets' output rows; `stream`: a whole panel's 16 floats, where their destination is a cache line,
// go past the caches (the caller fences after its last).
void store_tile(const Panel* p, int panels, const float* out, const QMatmulArgs& a, int64_t c0, int cols,
                bool stream = false) {
  for (int r = 0; r < panels; ++r) {
    const QMatmulTarget& t = *p[r].target;
    const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, t.w.rows - p[r].row0));
    for (int c = 0; c < cols; ++c) {
      const int64_t row = a.out_rows != nullptr ? a.out_rows[c0 + c] : c0 + c;
      float* dst = t.out + row * t.out_stride + p[r].row0;
      const float* f = out + (r * cols + c) * kPanelRows;
      // The bias test out of the loop: with it inside, GCC stored the floats one at a time (11% of a
      // 2048 x 8192 matmul against 64 rows on AMX tiles).
      if (t.bias == nullptr) {
#if defined(MINDIE_ISA_AVX512)
        if (stream && rows == kPanelRows && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
          _mm512_stream_ps(dst, _mm512_loadu_ps(f));
          continue;
        }
#endif
        std::memcpy(dst, f, sizeof(float) * rows);
      } else {
        const float* bias = t.bias + p[r].row0;
        for (int i = 0; i < rows; ++i) dst[i] = f[i] + bias[i];
      }
    }
  }
}

// f(std::integral_constant<int, n>) for 1 <= n <= N: a narrower group (a target's or a thread's
// last panels, the last activation rows) still runs as one tile.
template <int N, class F>
void with_count(int n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// tile(c0, cols) over the activation rows, C at a time and the rest as one narrower tile.
template <int C, class Tile>
void for_each_row_tile(int64_t m, Tile&& tile) {
  int64_t c0 = 0;
  for (; c0 + C <= m; c0 += C) tile(c0, std::integral_constant<int, C>{});
  if (c0 < m) with_count<C>(static_cast<int>(m - c0), [&](auto cols) { tile(c0, cols); });
}

// Panels p[0..R) of format F (staged in buf) against every activation row, C rows at a time.
template <class D, int R, QFormat F>
void apply(const Panel* p, const PanelBuffer<D>* buf, const QMatmulArgs& a, const std::vector<ActRef>& x) {
  constexpr QFormatInfo info = qformat_info(static_cast<int>(F));
  constexpr bool Signed = info.signed_q;
  constexpr int S = info.scale_span / 16;  // spans of 16 * S values
  StagedPanel<typename D::Weight> w[R];
  for (int r = 0; r < R; ++r) w[r] = buf[r].ref();
  const int64_t groups = a.k / 16;
  float out[R * D::kTileCols * kPanelRows];
  for_each_row_tile<D::kTileCols>(a.m, [&](int64_t c0, auto cols) {
    constexpr int C = decltype(cols)::value;
    if constexpr (D::kWide) D::template tile<R, C, Signed, S>(w, x.data() + c0, groups, out);  // one int16 product either way
    else if constexpr (D::kOnePlaneOnly) D::template tile<R, C, F>(w, x.data() + c0, groups, out);
    else if (a.planes == 1) D::template tile<R, C, F, 1>(w, x.data() + c0, groups, out);
    else D::template tile<R, C, F, 2>(w, x.data() + c0, groups, out);
    store_tile(p, R, out, a, c0, cols);
  });
}

template <class D, int R>
void apply_format(QFormat format, const Panel* p, const PanelBuffer<D>* buf, const QMatmulArgs& a,
                  const std::vector<ActRef>& x) {
  with_format(format, [&](auto f) { apply<D, R, decltype(f)::value>(p, buf, a, x); });
}

// The panels of every target of one call or of a batch of calls, back to back (target j owns panels
// [first[j], first[j + 1])), split over the threads as contiguous ranges: thread th takes
// [th * per, min(panels, (th + 1) * per)).
struct PanelSplit {
  const QMatmulTarget* targets[kMaxQMatmulTargets * kMaxQMatmulBatch];
  int call[kMaxQMatmulTargets * kMaxQMatmulBatch];  // the call target j belongs to
  int num_targets = 0;
  int64_t first[kMaxQMatmulTargets * kMaxQMatmulBatch + 1] = {0};
  int64_t panels, threads, per;

  PanelSplit(const QMatmulArgs* calls, int num_calls) {
    for (int c = 0; c < num_calls; ++c)
      for (int j = 0; j < calls[c].num_targets; ++j, ++num_targets) {
        targets[num_targets] = &calls[c].targets[j];
        call[num_targets] = c;
        first[num_targets + 1] = first[num_targets] + (calls[c].targets[j].w.rows + kPanelRows - 1) / kPanelRows;
      }
    panels = first[num_targets];
    threads = std::min<int64_t>(get_num_threads(), panels);
    per = (panels + threads - 1) / threads;
  }
  explicit PanelSplit(const QMatmulArgs& a) : PanelSplit(&a, 1) {}
  int target_of(int64_t pn) const {
    int j = 0;
    while (pn >= first[j + 1]) ++j;
    return j;
  }
  Panel locate(int64_t pn) const {
    const int j = target_of(pn);
    return Panel{targets[j], (pn - first[j]) * kPanelRows, call[j]};
  }
  // Asks for panels [begin, end) at once: a thread's first panels, before its own prefetches run ahead.
  void prefetch(int64_t begin, int64_t end) const {
    for (int64_t pn = begin; pn < end; ++pn) {
      const Panel p = locate(pn);
      prefetch_panel(p.target->w, p.row0);
    }
  }
  // f(begin, end) for each thread's range of panels, on the threads.
  template <class F>
  void run(F&& f) const {
    parallel_for(threads, 1, [&](int64_t tb, int64_t te) {
      for (int64_t th = tb; th < te; ++th) f(th * per, std::min(panels, (th + 1) * per));
    });
  }
  // The next range of panels for a thread to compute, claimed from `next`, each a share of what is
  // left (guided scheduling): a thread that the OS descheduled, or that shares its core with another
  // process, holds up the call by one small range at the end instead of half the matrix. A panel is
  // computed whole by whichever thread claims it, so the results do not depend on who does. Ranges
  // shrink to one panel at the end, so that the threads finish within about a panel of each other.
  // The share is what is left over the threads (OpenMP's guided rule): over twice the threads, the
  // 3B model's projections took 4 and 8 activation rows 1.2-1.3x as long on a 2-core Zen 5.
  std::pair<int64_t, int64_t> claim(std::atomic<int64_t>& next) const {
    int64_t begin = next.load(std::memory_order_relaxed), take;
    do {
      if (begin >= panels) return {panels, panels};
      take = std::max<int64_t>(1, (panels - begin) / threads);
    } while (!next.compare_exchange_weak(begin, begin + take, std::memory_order_relaxed));
    return {begin, std::min(panels, begin + take)};
  }
};

// The bytes of the panels a thread stages next, to be asked for while it computes the current ones.
struct PanelsAhead {
  const uint8_t* data = nullptr;
  int64_t bytes = 0;
};

// Stages every panel of a's targets (each into a Buffer) and hands them to `apply(p, buf, n, ahead)`
// up to `group` (at most R) at a time, n panels of one target (so that they share a format); `ahead`:
// the packed bytes of the thread's next group (its first target's part), or none.
template <int R, class Buffer, class Apply>
void for_each_panel_group(const QMatmulArgs& a, Apply&& apply_group, int group = R) {
  const PanelSplit split(a);
  split.run([&](int64_t begin, int64_t end) {
    thread_local Buffer buf[R];
    split.prefetch(begin, std::min(end, begin + group));
    for (int64_t pi = begin; pi < end;) {
      Panel p[R];
      int n = 0;
      const int j = split.target_of(pi);
      for (; n < group && pi < end && pi < split.first[j + 1]; ++n, ++pi) {
        p[n] = {split.targets[j], (pi - split.first[j]) * kPanelRows};
        const uint8_t* next = nullptr;  // the panel staged `group` on, when it is a packed one
        if (pi + group < end) {
          const Panel pn = split.locate(pi + group);
          if (pn.target->w.panels) next = pn.target->w.data + pn.row0 * pn.target->w.row_bytes;
        }
        buf[n].stage(split.targets[j]->w, p[n].row0, next);
      }
      PanelsAhead ahead;
      if (pi < end) {
        const int k = split.target_of(pi);
        const QMatrix& w = split.targets[k]->w;
        const int64_t panels = std::min({end, pi + group, split.first[k + 1]}) - pi;
        if (w.panels) ahead = {w.data + (pi - split.first[k]) * kPanelRows * w.row_bytes, panels * kPanelRows * w.row_bytes};
      }
      apply_group(p, buf, n, ahead);
    }
  });
}

// How many panels ahead of the one it computes a streaming thread prefetches.
constexpr int kStreamAhead = 2;

// A streaming thread's panels in the order it computes them, and the one kStreamAhead on, whose
// bytes it prefetches meanwhile (-1 past its last). Its ranges come from next_range() (an empty one
// ends them); the lookahead takes the next range as it leaves the current one, so that the prefetches
// run on across ranges instead of starting cold at each.
template <class NextRange>
class PanelWalk {
 public:
  explicit PanelWalk(NextRange next_range) : next_range_(next_range) {
    for (int64_t& pn : ring_) pn = pull();
  }
  int64_t current() const { return ring_[head_]; }
  int64_t ahead(int n = kStreamAhead) const { return ring_[(head_ + n) % kRing]; }
  void advance() {
    ring_[head_] = pull();
    head_ = (head_ + 1) % kRing;
  }

 private:
  static constexpr int kRing = kStreamAhead + 1;
  int64_t pull() {
    if (at_ == end_) {
      if (done_) return -1;
      std::tie(at_, end_) = next_range_();
      if (at_ >= end_) {
        done_ = true;
        return -1;
      }
    }
    return at_++;
  }
  NextRange next_range_;
  int64_t ring_[kRing];
  int head_ = 0;
  int64_t at_ = 0, end_ = 0;
  bool done_ = false;
};

// C activation rows against every packed panel as it lies (D::stream), with no staging: the
// decode path.
// Calls of fewer weight bytes split into fixed ranges: each claim costs a cache line passed between
// the cores, which a call of a few microseconds (a 135M model's q/k/v) does not repay.
constexpr int64_t kClaimedBytes = int64_t{1} << 20;

// The C rows of each call (xs[i] the rows of calls[i]) as D::stream reads them, in rows[i] (buffers
// kept from call to call). A copy of 72 bytes a row and block; on a Zen 5 core all the projections of
// a 3B decode step at 8 rows took 75-77 ms with it against 95-96 without.
template <int C>
void interleave_rows(const QMatmulArgs* calls, int num_calls, const std::vector<ActRef>* xs, StreamRows* rows) {
  thread_local ScratchVector<int8_t> planes_buffer[kMaxQMatmulBatch];
  thread_local ScratchVector<float> scales_buffer[kMaxQMatmulBatch];
  for (int i = 0; i < num_calls; ++i) {
    const int64_t blocks = calls[i].k / 32;
    int8_t* planes = sized(planes_buffer[i], blocks * C * 64);
    float* d = sized(scales_buffer[i], blocks * C * 4);
    float* sum32 = d + blocks * C;
    float* sum16 = sum32 + blocks * C;
    for (int64_t b = 0; b < blocks; ++b)
      for (int c = 0; c < C; ++c) {
        const ActRef& x = xs[i][c];
        std::memcpy(planes + (b * C + c) * 64, x.hi + 32 * b, 32);
        std::memcpy(planes + (b * C + c) * 64 + 32, x.lo + 32 * b, 32);
        d[b * C + c] = x.d[b];
        sum32[b * C + c] = x.sum32[b];
        for (int e = 0; e < 2; ++e) sum16[(2 * b + e) * C + c] = x.sum16[2 * b + e];
      }
    rows[i] = {planes, d, sum32, sum16};
  }
}

// C activation rows of each call (xs[c] the rows of calls[c]) against every packed panel of its
// targets, as it lies.
template <class D, int C>
void stream_panels(const QMatmulArgs* calls, int num_calls, const std::vector<ActRef>* xs) {
  StreamRows rows[kMaxQMatmulBatch];
  interleave_rows<C>(calls, num_calls, xs, rows);
  const PanelSplit split(calls, num_calls);
  int64_t bytes = 0;
  for (int j = 0; j < split.num_targets; ++j) bytes += packed_rows(split.targets[j]->w.rows) * split.targets[j]->w.row_bytes;
#if defined(MINDIE_ISA_AVX512)
  const bool burst = C == 1 && use_burst_prefetch();  // the prefetch schedule (Int8Panel::stream)
#endif
  const auto walk_panels = [&](auto next_range) {
    PanelWalk walk(next_range);
    for (int n = 0; n < kStreamAhead && walk.ahead(n) >= 0; ++n) split.prefetch(walk.ahead(n), walk.ahead(n) + 1);
    for (; walk.current() >= 0; walk.advance()) {
      const Panel p = split.locate(walk.current());
      const QMatrix& w = p.target->w;
      const int64_t blocks = w.cols / 32;
      const uint8_t* pf = nullptr;
      int64_t pf_bytes = 0;
      if (walk.ahead() >= 0) {
        const Panel n = split.locate(walk.ahead());
        pf = n.target->w.data + n.row0 * n.target->w.row_bytes;
        pf_bytes = panel_bytes(n.target->w, n.row0);
      }
      const int64_t pf_step = (pf_bytes / blocks + 63) / 64 * 64;
      const uint8_t* panel = w.data + p.row0 * w.row_bytes;
      float out[C * kPanelRows];
      with_format(w.format, [&](auto format) {
        constexpr QFormat F = decltype(format)::value;
        const auto stream = [&](auto planes) {
          constexpr int P = decltype(planes)::value;
#if defined(MINDIE_ISA_AVX512)
          if constexpr (C == 1)
            if (burst) return D::template stream<F, 1, P, true>(panel, blocks, rows[p.call], pf, pf + pf_bytes, pf_step, out);
#endif
          D::template stream<F, C, P>(panel, blocks, rows[p.call], pf, pf + pf_bytes, pf_step, out);
        };
        // One row reads the lo plane's zeros too: the same bits, and where the panel walk waits on
        // memory, fewer products per block made it slower (a Zen 5 core, 600 MB of 8192 x 3072 Q4_K at
        // one row: 26.8-26.9 GB/s with the plane skipped against 35.9-36.4; 2 threads 36.4-36.7 against
        // 42.0-44.1). From 2 rows on, skipping it is as fast or faster (8 rows: 36.1-36.4 against 22.0-22.1).
        if constexpr (C > 1)
          if (calls[p.call].planes == 1) return stream(std::integral_constant<int, 1>{});
        stream(std::integral_constant<int, 2>{});
      });
      store_tile(&p, 1, out, calls[p.call], 0, C);
    }
  };
  if (bytes >= kClaimedBytes) {
    std::atomic<int64_t> next{0};
    return split.run([&](int64_t, int64_t) { walk_panels([&] { return split.claim(next); }); });
  }
  split.run([&](int64_t begin, int64_t end) {
    bool given = false;
    walk_panels([&] { return std::exchange(given, true) ? std::pair<int64_t, int64_t>{end, end} : std::pair{begin, end}; });
  });
}

// Each activation row's planes, scales and sums per 16 and per 32 values, shared by every panel, in
// `sums` and `x` (buffers kept from call to call).
void prepare_activations(const QMatmulArgs& a, std::vector<float>& sums, std::vector<ActRef>& x) {
  const int64_t k = a.k, groups = k / 16;
  sums.resize(a.m * (groups + groups / 2));
  x.resize(a.m);
  parallel_for(a.m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int8_t* hi = a.xq + c * 2 * k;
      const int8_t* lo = hi + k;
      const float* d = a.xd + c * (k / 32);
      float* sum16 = sums.data() + c * (groups + groups / 2);
      float* sum32 = sum16 + groups;
      for (int64_t j = 0; j < groups; j += 2) {
        const int32_t s[2] = {plane_sum16(hi + 16 * j, lo + 16 * j), plane_sum16(hi + 16 * j + 16, lo + 16 * j + 16)};
        sum16[j] = static_cast<float>(s[0]) * d[j / 2];
        sum16[j + 1] = static_cast<float>(s[1]) * d[j / 2];
        sum32[j / 2] = static_cast<float>(s[0] + s[1]) * d[j / 2];
      }
      x[c] = {hi, lo, nullptr, d, sum16, sum32};
    }
  });
}

// Whether D streams a's rows against its targets as they lie (few rows, every target packed in panels).
template <class D>
bool streams(const QMatmulArgs& a) {
  bool packed = a.m >= 1 && a.m <= D::kStreamCols;
  for (int j = 0; j < a.num_targets; ++j) packed = packed && a.targets[j].w.panels;
  return packed;
}

// Rows [r0, r0 + n) of a call, as a call of their own.
QMatmulArgs rows_of(const QMatmulArgs& a, int64_t r0, int64_t n) {
  QMatmulArgs part = a;
  part.m = n;
  part.xq = a.xq + r0 * 2 * a.k;
  part.xd = a.xd + r0 * (a.k / 32);
  if (a.out_rows != nullptr) part.out_rows = a.out_rows + r0;
  else
    for (int j = 0; j < a.num_targets; ++j) part.targets[j].out += r0 * a.targets[j].out_stride;
  return part;
}

// Rows a variant with int16 activations (Int8Panel::kWide) widens at a time: a prompt of thousands
// of rows would otherwise hold as many bytes again as its planes (235 MB at 8192 rows of 14336).
// Each chunk stages the panels anew, well under 1% beside its rows' products.
constexpr int64_t kWideRows = 256;

template <class D>
constexpr bool on_amx_tiles() {
#if defined(MINDIE_AMX)
  return std::is_same_v<D, AmxInt8Panel>;
#else
  return false;
#endif
}

#if defined(MINDIE_AMX)
// A widened activation row (AmxInt8Panel::widen: 128 * hi, then lo) is 2k bf16 values and a cache
// line: the A tiles read 16 rows at one stride, and at a power of two (k = 2048: 8 KiB) all 16 fall
// into one L1 set, which cost 30% (2048 x 8192 against 64 rows).
constexpr int64_t kWideRowPad = 32;

// Staged panels p[0..n) (32-value spans) against every activation row on AMX tiles, 16 rows and two
// panels at a time. The next group's packed panels stream into L2 meanwhile, a few lines a span:
// asked for while staging (for_each_panel_group's prefetches), they were still on their way when
// staged (the staging took 13% of a 32-row decode step of Llama-3.2-3B, mostly waiting on them).
void apply_amx_int8(const Panel* p, const PanelBuffer<AmxInt8Panel>* buf, int n, const QMatmulArgs& a,
                    const std::vector<ActRef>& x, const bf16_t* wide, PanelsAhead ahead) {
  constexpr int kBlock = AmxInt8Panel::kRowBlock, S = 2;
  const int64_t row = 2 * a.k + kWideRowPad;
  const int64_t spans = (a.m + kBlock - 1) / kBlock * ((n + 1) / 2) * (a.k / (16 * S));
  SpreadPrefetch prefetch{ahead.data, ahead.data + ahead.bytes, (ahead.bytes / 64 + spans - 1) / spans};
  const AmxInt8Panel::Session session(16 * S);
  StagedPanel<bf16_t> w[AmxInt8Panel::kTilePanels];
  for (int r = 0; r < n; ++r) w[r] = buf[r].ref();
  float out[AmxInt8Panel::kTilePanels * kBlock * kPanelRows];
  for (int64_t c0 = 0; c0 < a.m; c0 += kBlock) {
    const int cols = static_cast<int>(std::min<int64_t>(kBlock, a.m - c0));
    const bf16_t* hi = wide + c0 * row;
    for (int r = 0; r < n; r += 2) {
      float* at = out + r * cols * kPanelRows;
      if (r + 1 < n) AmxInt8Panel::tile<2, S>(w + r, x.data() + c0, hi, hi + a.k, 2 * row, a.k / 16, cols, at, prefetch);
      else AmxInt8Panel::tile<1, S>(w + r, x.data() + c0, hi, hi + a.k, 2 * row, a.k / 16, cols, at, prefetch);
    }
    store_tile(p, n, out, a, c0, cols);
  }
}

// The rows past the streaming ones on AMX tiles: widened once, in blocks of 16 (the last padded with
// zero rows, whose d and sums are the first row's: read, never stored).
void run_amx_int8(const QMatmulArgs& a, std::vector<ActRef>& x) {
  constexpr int kBlock = AmxInt8Panel::kRowBlock;
  const int64_t rows = (a.m + kBlock - 1) / kBlock * kBlock, row = 2 * a.k + kWideRowPad;
  thread_local ScratchVector<bf16_t> wide_buffer;
  bf16_t* wide = sized(wide_buffer, rows * row);
  parallel_for(rows, kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      bf16_t* at = wide + c * row;
      if (c < a.m) AmxInt8Panel::widen(x[c].hi, x[c].lo, a.k, at, at + a.k);
      else std::fill(at, at + 2 * a.k, bf16_t{0});
    }
  });
  const ActRef first = x[0];
  x.resize(rows, first);
  for_each_panel_group<AmxInt8Panel::kTilePanels, PanelBuffer<AmxInt8Panel>>(a, [&](const Panel* p, const PanelBuffer<AmxInt8Panel>* buf, int n, PanelsAhead ahead) {
    with_format(p[0].target->w.format, [&](auto f) {
      constexpr QFormatInfo info = qformat_info(static_cast<int>(decltype(f)::value));
      if constexpr (!info.signed_q && info.scale_span == 32) apply_amx_int8(p, buf, n, a, x, wide, ahead);
    });
  });
}

// The AMX tiles compute rows 16 at a time and beat the VNNI byte tile by 12-18% from 32 rows (two
// Sapphire Rapids cores, 2048 x 8192 Q4_K, ms, AMX against vpdpbusd: 32 rows 2.26-2.42 against
// 2.49-2.75, 48 rows 3.4-3.6 against 3.9-4.1, 128 rows 8.2-8.6 against 9.7-10.0, 512 rows 35 against
// 43; 24 rows, padded to 32, 2.6 against 2.1-2.3). Q6_K's 16-value spans stay on vpdpbusd: one tile
// product of half depth per plane was slower (32 rows 3.5 against 3.2-3.3), and so was one of full
// depth over each group's 128 * hi and lo side by side against its q staged twice (k = 2048, 48 rows
// 4.3-4.5 against 3.5-3.7): the float chain and the store of the sums come every 16 values.
constexpr int64_t kAmxInt8Rows = 32;

// Nor do the tiles win on longer rows: the widened rows (4 bytes a value, where vpdpbusd reads the
// two int8 planes) and a group's staged panels outgrow L2 together, and the tiles fall behind (the
// same two cores, Q4_K against 32 rows, ms, AMX against vpdpbusd: k = 3072 3.0-3.3 against 3.3-3.7,
// k = 4096 4.7-4.8 against 4.6-4.8, k = 6144 4.1-4.2 against 3.5-3.6, k = 8192 4.9 against 3.4-3.7;
// cutting k into chunks, two panels a group or huge pages did not bring k = 8192 back).
constexpr int64_t kAmxInt8MaxK = 4096;

// Whether a's rows take AMX tiles: where the CPU has AMX-BF16 (and VNNI for the streaming rows of
// other calls), from kAmxInt8Rows rows and with the padding to 16 under an eighth, k up to
// kAmxInt8MaxK, every target's q unsigned over 32-value spans. Either path gives the same bits, so the
// shape may choose.
bool amx_int8_rows(const QMatmulArgs& a) {
  const int64_t padded = (a.m + AmxInt8Panel::kRowBlock - 1) / AmxInt8Panel::kRowBlock * AmxInt8Panel::kRowBlock;
  if (a.m < kAmxInt8Rows || 8 * padded > 9 * a.m || a.k > kAmxInt8MaxK || !use_amx_bf16() || !use_avx512_vnni()) return false;
  for (int j = 0; j < a.num_targets; ++j) {
    const QFormatInfo info = qformat_info(static_cast<int>(a.targets[j].w.format));
    if (info.signed_q || info.scale_span != 32) return false;
  }
  return true;
}
#endif

template <class D>
void run_int8(const QMatmulArgs& a) {
  if constexpr (D::kWide) {
    if (a.m > kWideRows) {
      for (int64_t r0 = 0; r0 < a.m; r0 += kWideRows) run_int8<D>(rows_of(a, r0, std::min(kWideRows, a.m - r0)));
      return;
    }
  }
  // The caller's buffers, named once here: inside the job a thread_local would be the worker's own.
  thread_local std::vector<float> sums_buffer;
  thread_local std::vector<ActRef> x_buffer;
  thread_local ScratchVector<int16_t> wide_buffer;
  std::vector<ActRef>& x = x_buffer;
  prepare_activations(a, sums_buffer, x);
  if constexpr (D::kStreamCols > 0) {
    if (streams<D>(a))
      return with_count<D::kStreamCols>(static_cast<int>(a.m), [&](auto cols) { stream_panels<D, decltype(cols)::value>(&a, 1, &x); });
  }
  if constexpr (on_amx_tiles<D>()) {
#if defined(MINDIE_AMX)
    run_amx_int8(a, x);
#endif
  } else {
    if constexpr (D::kWide) {
      int16_t* wide = sized(wide_buffer, a.m * a.k);
      parallel_for(a.m, 16, [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) {
          D::widen(x[c].hi, x[c].lo, a.k, wide + c * a.k);
          x[c].wide = wide + c * a.k;
        }
      });
    }
    for_each_panel_group<D::kTilePanels, PanelBuffer<D>>(a, [&](const Panel* p, const PanelBuffer<D>* buf, int n, PanelsAhead) {
      with_count<D::kTilePanels>(n, [&](auto panels) { apply_format<D, decltype(panels)::value>(p[0].target->w.format, p, buf, a, x); });
    });
  }
}

// A batch of int8 calls: those that stream with one row count in one walk over all their panels,
// any other call alone.
template <class D>
void run_int8_batch(const QMatmulBatchArgs& b) {
  bool together = b.num_calls > 1 && D::kStreamCols > 0;
  for (int c = 0; c < b.num_calls; ++c)
    together = together && b.calls[c].xb == nullptr && b.calls[c].m == b.calls[0].m &&
               b.calls[c].planes == b.calls[0].planes && streams<D>(b.calls[c]);
  if (!together) {
    for (int c = 0; c < b.num_calls; ++c) qmatmul(b.calls[c]);
    return;
  }
  if constexpr (D::kStreamCols > 0) {
    thread_local std::vector<float> sums_buffer[kMaxQMatmulBatch];
    thread_local std::vector<ActRef> x_buffer[kMaxQMatmulBatch];
    std::vector<ActRef>* xs = x_buffer;
    for (int c = 0; c < b.num_calls; ++c) prepare_activations(b.calls[c], sums_buffer[c], xs[c]);
    with_count<D::kStreamCols>(static_cast<int>(b.calls[0].m), [&](auto cols) {
      stream_panels<D, decltype(cols)::value>(b.calls, b.num_calls, xs);
    });
  }
}

// Bf16 panels w[0..R) against every activation row, B's tile at a time.
template <class B, int R>
void apply_bf16(const Panel* p, const bf16_t* const* w, const QMatmulArgs& a, const std::vector<const bf16_t*>& x) {
  const int64_t pairs = a.k / 2;
  float out[R * B::kTileCols * kPanelRows];
  for_each_row_tile<B::kTileCols>(a.m, [&](int64_t c0, auto cols) {
    B::template tile<R, decltype(cols)::value>(w, x.data() + c0, pairs, out);
    store_tile(p, R, out, a, c0, cols);
  });
}

constexpr int64_t kBf16GroupBytes = 768 << 10;

// k in chunks of at most this many 32-value blocks on AMX tiles (equal chunks): a group then holds
// kBf16GroupBytes / (chunk values * 32 bytes) panels, 12 to 16, where a whole k = 8192 left room for
// 3, and every group reads all the activation rows once. The rows stream from memory at about 22
// GB/s on two Sapphire Rapids cores, so that 3 panels a pass held a 512-row k = 8192 matmul to its
// reads (20-21 ms, 1.3 TFLOP/s; 13.7 ms at k = 3072, 8 panels; 13.6-14.3 ms in chunks).
constexpr int64_t kBf16ChunkBlocks = 64;

// Outputs of more than this many bytes are written past the caches: read back from memory by the
// next step anyway, they would only cost a read of each line before its write (the write-allocate)
// and push out what the tiles reuse.
constexpr int64_t kStreamOutputBytes = 16 << 20;

bool streams_output(const QMatmulArgs& a) {
  int64_t cols = 0;
  for (int j = 0; j < a.num_targets; ++j) cols += a.targets[j].w.rows;
  return a.m * cols * static_cast<int64_t>(sizeof(float)) > kStreamOutputBytes;
}

// Panels p[0..n) (n <= group) against every activation row on AMX tiles, a k-chunk at a time: each
// chunk's panels staged, then every block of 32 rows through them, the float32 sums of the 16 x 16
// tiles carried from chunk to chunk in acc (exactly: a tile stored and loaded again holds the same
// bits, so the chunks leave each element's sum as one pass over k makes it).
template <class B>
void apply_bf16_chunks(const Panel* p, Bf16ChunkBuffer<B>* buf, int n, const QMatmulArgs& a,
                       const std::vector<const bf16_t*>& x, int64_t chunk_blocks) {
  constexpr int R = B::kTilePanels, kBlock = B::kRowBlock;
  const int64_t blocks = a.k / 32, row_blocks = (a.m + kBlock - 1) / kBlock, block_floats = n * kBlock * kPanelRows;
  thread_local ScratchVector<float> acc_buffer;
  float* acc = sized(acc_buffer, row_blocks * block_floats);
  for (int64_t b0 = 0; b0 < blocks; b0 += chunk_blocks) {
    const int64_t b1 = std::min(blocks, b0 + chunk_blocks);
    const bf16_t* w[R];
    for (int r = 0; r < n; ++r) {
      buf[r].stage_chunk(b0, b1);
      w[r] = buf[r].data;
    }
    const typename B::Session session;
    for (int64_t c0 = 0; c0 < a.m; c0 += 2 * kBlock)
      B::tile(w, n, x.data() + c0, a.m - c0 > kBlock, 16 * b0, 16 * b1, 2 * a.k, b0 > 0, acc + c0 / kBlock * block_floats,
              block_floats);
  }
  float out[R * kBlock * kPanelRows];
  const bool stream = streams_output(a);
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    const int cols = static_cast<int>(std::min<int64_t>(kBlock, a.m - rb * kBlock));
    const float* f = acc + rb * block_floats;
    if (cols < kBlock) {
      for (int r = 0; r < n; ++r) std::memcpy(out + r * cols * kPanelRows, f + r * kBlock * kPanelRows, sizeof(float) * cols * kPanelRows);
      f = out;
    }
    store_tile(p, n, f, a, rb * kBlock, cols, stream);
  }
#if defined(MINDIE_ISA_AVX512)
  if (stream) _mm_sfence();
#endif
}

// Whether B's tiles read whole blocks of rows (AMX) and so take k in chunks.
template <class B>
constexpr bool tiles_in_chunks() {
  return B::kRowBlock > 1;
}

// Bf16 activations: each panel is staged as a bf16 panel (B::stage_block), once per call, then
// applied to every row. AMX tiles, which read whole blocks of rows, stage as many panels as keep
// their bf16 copies of a k-chunk within kBf16GroupBytes, so that they stay in L2 while the activation
// rows stream past them once per group.
template <class B>
void run_bf16(const QMatmulArgs& a) {
  constexpr int R = B::kTilePanels;
  std::vector<const bf16_t*> x(a.m);
  for (int64_t c = 0; c < a.m; ++c) x[c] = a.xb + c * a.k;
  // B reads rows in blocks of kRowBlock: the last partial block from a zero-padded copy.
  ScratchVector<bf16_t> tail;
  if (const int64_t full = a.m / B::kRowBlock * B::kRowBlock; full < a.m) {
    tail.assign(B::kRowBlock * a.k, bf16_t{});
    std::copy(a.xb + full * a.k, a.xb + a.m * a.k, tail.begin());
    for (int64_t c = full; c < a.m; ++c) x[c] = tail.data() + (c - full) * a.k;
  }
  if constexpr (tiles_in_chunks<B>()) {
    const int64_t blocks = a.k / 32, chunks = (blocks + kBf16ChunkBlocks - 1) / kBf16ChunkBlocks;
    const int64_t chunk_blocks = (blocks + chunks - 1) / chunks;
    const int group = static_cast<int>(std::clamp<int64_t>(kBf16GroupBytes / (chunk_blocks * 2 * kBf16PanelGroupElems * 2), 2, R));
    for_each_panel_group<R, Bf16ChunkBuffer<B>>(a, [&](const Panel* p, Bf16ChunkBuffer<B>* buf, int n, PanelsAhead) {
      apply_bf16_chunks<B>(p, buf, n, a, x, chunk_blocks);
    }, group);
  } else {
    for_each_panel_group<R, Bf16PanelBuffer<B>>(a, [&](const Panel* p, const Bf16PanelBuffer<B>* buf, int n, PanelsAhead) {
      const typename B::Session session;
      const bf16_t* w[R];
      for (int r = 0; r < n; ++r) w[r] = buf[r].data;
      with_count<R>(n, [&](auto panels) { apply_bf16<B, decltype(panels)::value>(p, w, a, x); });
    });
  }
}

}  // namespace

void quantize_activations(const QuantizeActivationsArgs& a) {
  if (a.planes != 1 && a.planes != 2) throw std::invalid_argument("quantize_activations: planes must be 1 or 2");
  const int64_t blocks = a.k / 32;
  parallel_for(a.m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* hi = a.q + r * 2 * a.k;
      int8_t* lo = hi + a.k;
      for (int64_t b = 0; b < blocks; ++b) a.d[r * blocks + b] = quantize_block32(a.x + r * a.x_stride + 32 * b, hi + 32 * b, lo + 32 * b);
      // hi is the same either way: one plane is two with what hi leaves dropped.
      if (a.planes == 1) std::memset(lo, 0, a.k);
    }
  });
}

void round_to_bf16(const RoundToBf16Args& a) {
  parallel_for(a.m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = a.x + r * a.x_stride;
      bf16_t* out = a.out + r * a.k;
      int64_t i = 0;
      for (; i + VecF::W <= a.k; i += VecF::W) VecF::load(x + i).store(out + i);
      if (i < a.k) VecF::load_partial(x + i, static_cast<int>(a.k - i)).store_partial(out + i, static_cast<int>(a.k - i));
    }
  });
}

void qmatmul(const QMatmulArgs& a) {
  if (a.xb != nullptr) {
#if defined(MINDIE_AMX)
    if (use_amx_bf16()) return run_bf16<AmxBf16Panel>(a);
#endif
#if defined(MINDIE_ISA_AVX512) && defined(MINDIE_BF16_DOT)
    if (cpu_has_avx512_bf16()) return run_bf16<Bf16Panel>(a);
#endif
    return run_bf16<Bf16PanelGeneric>(a);
  }
#if defined(MINDIE_AMX)
  if (amx_int8_rows(a)) return run_int8<AmxInt8Panel>(a);
#endif
#if defined(MINDIE_ISA_AVX512) && defined(MINDIE_VNNI)
  if (use_avx512_vnni()) {
    bool signed_q = false;
    for (int j = 0; j < a.num_targets; ++j) signed_q = signed_q || qformat_info(static_cast<int>(a.targets[j].w.format)).signed_q;
    // Signed q against two planes: one int16 product (WidePanel) where the byte tile takes two, and
    // with the sign moves. Against one plane, the byte tile's single product wins.
    return signed_q && a.planes == 2 ? run_int8<WidePanel<true>>(a) : run_int8<Int8Panel<true>>(a);
  }
#endif
#if defined(MINDIE_ISA_AVX2)
  // One plane: a byte product per weight (BytePanel) where the int16 tile takes one per value of
  // 128 * hi + lo.
#if defined(MINDIE_AVX_VNNI)
  if (use_avx_vnni()) return a.planes == 1 ? run_int8<BytePanel<true>>(a) : run_int8<Int8Panel<true>>(a);
#endif
  return a.planes == 1 ? run_int8<BytePanel<false>>(a) : run_int8<Int8Panel<false>>(a);
#elif defined(MINDIE_ISA_AVX512)
  // One plane: the byte tile's products, in int16 pairs (Int8Panel::one_plane_pairs).
  return a.planes == 1 ? run_int8<Int8Panel<false>>(a) : run_int8<WidePanel<false>>(a);
#else
  run_int8<Int8Panel<false>>(a);
#endif
}

void qmatmul_batch(const QMatmulBatchArgs& b) {
  if (b.num_calls < 0 || b.num_calls > kMaxQMatmulBatch)
    throw std::invalid_argument("qmatmul_batch: 0 to " + std::to_string(kMaxQMatmulBatch) + " calls, got " +
                                std::to_string(b.num_calls));
#if defined(MINDIE_ISA_AVX512) && defined(MINDIE_VNNI)
  if (use_avx512_vnni()) return run_int8_batch<Int8Panel<true>>(b);
#endif
#if defined(MINDIE_ISA_AVX2) && defined(MINDIE_AVX_VNNI)
  if (use_avx_vnni()) return run_int8_batch<Int8Panel<true>>(b);
#endif
  run_int8_batch<Int8Panel<false>>(b);
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
