#include "cpu/parallel.h"

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

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads) : spin_us_(env_int("MINDIE_SPIN_US", 20)) {
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
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
  // caller then simply does every chunk itself. It waits only for workers inside the job.
  void run(int64_t n, int64_t grain, RangeFn fn, void* ctx) {
    std::lock_guard<std::mutex> call_lock(call_mu_);
    fn_ = fn;
    ctx_ = ctx;
    n_ = n;
    grain_ = grain;
    next_.store(0, std::memory_order_relaxed);
    closed_.store(false, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work();
    closed_.store(true, std::memory_order_seq_cst);
    while (active_.load(std::memory_order_seq_cst) != 0) MINDIE_PAUSE();
  }

 private:
  void work() {
    t_inside_job = true;
    for (;;) {
      int64_t b = next_.fetch_add(grain_, std::memory_order_relaxed);
      if (b >= n_) break;
      int64_t e = b + grain_ < n_ ? b + grain_ : n_;
      fn_(ctx_, b, e);
    }
    t_inside_job = false;
  }

  void worker_loop() {
    uint64_t seen = 0;
    for (;;) {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      bool ready = false;
      for (int i = 0;; ++i) {
        if (generation_.load(std::memory_order_acquire) != seen) { ready = true; break; }
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) break;
        MINDIE_PAUSE();
      }
      if (!ready) {
        std::unique_lock<std::mutex> lk(mu_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lk, [&] { return stop_ || generation_.load(std::memory_order_seq_cst) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_relaxed);
        if (stop_) return;
      }
      seen = generation_.load(std::memory_order_acquire);
      // Enter, then check the job is still open: the caller closes it before waiting for
      // active_ to drain, so a late worker never touches a finished job.
      active_.fetch_add(1, std::memory_order_seq_cst);
      if (!closed_.load(std::memory_order_seq_cst) && generation_.load(std::memory_order_seq_cst) == seen) work();
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  const int spin_us_;
  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one job at a time when several Python threads call kernels
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> active_{0};   // workers inside the current job
  std::atomic<bool> closed_{true};  // every chunk of the current job has been claimed
  std::atomic<int> sleeping_{0};
  RangeFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  int64_t grain_ = 1;
  std::atomic<int64_t> next_{0};
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
