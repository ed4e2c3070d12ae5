#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MINDIE_PAUSE() _mm_pause()
#else
#define MINDIE_PAUSE() std::this_thread::yield()
#endif

namespace mindie::kernels::cpu {
namespace {

int env_int(const char* name, int fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  int v = std::atoi(s);
  return v > 0 ? v : fallback;
}

thread_local bool t_inside_job = false;

// A job is published as one word, generation << 8 | chunks: `chunks` > 0 for a job of at most one
// chunk per thread (thread i, the caller being 0, runs chunk i), 0 for a job whose chunks are
// claimed one by one from a shared counter.
//
// One chunk per thread is how the matmuls split their work, and it keeps a call to about two cache
// line transfers: a worker claims its chunk on its own slot's line (a compare-and-swap that stays in
// its cache) and reports it done there; the caller reads the slot only when its own chunk is done.
// A worker that has not claimed its chunk by then (asleep, or not scheduled) loses it to the caller.
class ThreadPool {
 public:
  explicit ThreadPool(int num_threads)
      : spin_us_(env_int("MINDIE_SPIN_US", 20)), slots_(num_threads > 1 ? num_threads - 1 : 0) {
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // The caller never waits for a worker that has not started: when torch's OpenMP threads still
  // spin on the cores after a GEMM, a sleeping worker may not run for a whole time slice, and the
  // caller then simply does its chunks itself. It waits only for chunks a worker has taken.
  void run(int64_t n, int64_t grain, RangeFn fn, void* ctx) {
    std::lock_guard<std::mutex> call_lock(call_mu_);
    job_.fn = fn;
    job_.ctx = ctx;
    job_.n = n;
    job_.grain = grain;
    const int64_t chunks = (n + grain - 1) / grain;
    const uint64_t g = ++generation_count_;
    if (chunks <= size() && chunks <= kMaxChunksInWord) {
      publish(g << 8 | static_cast<uint64_t>(chunks));
      t_inside_job = true;
      fn(ctx, 0, std::min(n, grain));
      for (int64_t i = 1; i < chunks; ++i) {
        Slot& slot = slots_[i - 1];
        uint64_t claimed = slot.claimed.load(std::memory_order_acquire);
        if (claimed < g && slot.claimed.compare_exchange_strong(claimed, g, std::memory_order_acq_rel)) {
          fn(ctx, i * grain, std::min(n, (i + 1) * grain));
          continue;
        }
        while (slot.done.load(std::memory_order_acquire) != g) MINDIE_PAUSE();
      }
      t_inside_job = false;
      return;
    }
    shared_.next.store(0, std::memory_order_relaxed);
    shared_.closed.store(false, std::memory_order_relaxed);
    publish(g << 8);
    work();
    shared_.closed.store(true, std::memory_order_seq_cst);
    while (shared_.active.load(std::memory_order_seq_cst) != 0) MINDIE_PAUSE();
  }

 private:
  void publish(uint64_t word) {
    job_.word.store(word, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
  }

  void work() {
    t_inside_job = true;
    for (;;) {
      int64_t b = shared_.next.fetch_add(job_.grain, std::memory_order_relaxed);
      if (b >= job_.n) break;
      int64_t e = b + job_.grain < job_.n ? b + job_.grain : job_.n;
      job_.fn(job_.ctx, b, e);
    }
    t_inside_job = false;
  }

  void worker_loop(int index) {
    Slot& slot = slots_[index - 1];
    uint64_t seen = 0;
    for (;;) {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      bool ready = false;
      for (int i = 0;; ++i) {
        if (job_.word.load(std::memory_order_acquire) != seen) { ready = true; break; }
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) break;
        MINDIE_PAUSE();
      }
      if (!ready) {
        std::unique_lock<std::mutex> lk(mu_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lk, [&] { return stop_ || job_.word.load(std::memory_order_seq_cst) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_relaxed);
        if (stop_) return;
      }
      seen = job_.word.load(std::memory_order_acquire);
      const uint64_t g = seen >> 8, chunks = seen & kMaxChunksInWord;
      if (chunks > 0) {
        // Job g's fields stay put from a successful claim until this chunk is reported done.
        uint64_t claimed = slot.claimed.load(std::memory_order_relaxed);
        if (static_cast<uint64_t>(index) < chunks && claimed < g &&
            slot.claimed.compare_exchange_strong(claimed, g, std::memory_order_acq_rel)) {
          t_inside_job = true;
          job_.fn(job_.ctx, index * job_.grain, std::min(job_.n, (index + 1) * job_.grain));
          t_inside_job = false;
          slot.done.store(g, std::memory_order_release);
        }
        continue;
      }
      // Enter, then check the job is still open: the caller closes it before waiting for
      // `active` to drain, so a late worker never touches a finished job.
      shared_.active.fetch_add(1, std::memory_order_seq_cst);
      if (!shared_.closed.load(std::memory_order_seq_cst) && job_.word.load(std::memory_order_seq_cst) == seen) work();
      shared_.active.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  struct alignas(64) Job {
    std::atomic<uint64_t> word{0};
    RangeFn fn = nullptr;
    void* ctx = nullptr;
    int64_t n = 0;
    int64_t grain = 1;
  };
  struct alignas(64) Shared {          // the chunk-by-chunk jobs
    std::atomic<int64_t> next{0};
    std::atomic<int> active{0};        // workers inside the current job
    std::atomic<bool> closed{true};    // every chunk of the current job has been claimed
  };
  struct alignas(64) Slot {            // a worker's chunk of a one-chunk-per-thread job
    std::atomic<uint64_t> claimed{0};  // the last generation whose chunk was taken (by either side)
    std::atomic<uint64_t> done{0};     // the last generation whose chunk the worker finished
  };

  static constexpr uint64_t kMaxChunksInWord = 0xFF;
  const int spin_us_;
  Job job_;
  Shared shared_;
  std::vector<Slot> slots_;
  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one job at a time when several Python threads call kernels
  uint64_t generation_count_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<int> sleeping_{0};
};

std::mutex g_pool_mu;
std::shared_ptr<ThreadPool> g_pool;  // shared: a resize never pulls a pool from under a running job
int g_requested = 0;

std::shared_ptr<ThreadPool> pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (!g_pool) {
    int n = g_requested > 0 ? g_requested
                            : env_int("MINDIE_NUM_THREADS", static_cast<int>(std::thread::hardware_concurrency()));
    g_pool = std::make_shared<ThreadPool>(n > 0 ? n : 1);
  }
  return g_pool;
}

}  // namespace

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  g_requested = n > 0 ? n : 1;
  g_pool.reset();  // rebuilt lazily at the requested size
}

int get_num_threads() { return pool()->size(); }

void parallel_run(int64_t n, int64_t grain, RangeFn fn, void* ctx) {
  if (n <= 0) return;
  if (t_inside_job || n <= grain) {
    fn(ctx, 0, n);
    return;
  }
  std::shared_ptr<ThreadPool> p = pool();
  if (p->size() == 1) {
    fn(ctx, 0, n);
    return;
  }
  p->run(n, grain, fn, ctx);
}

}  // namespace mindie::kernels::cpu
