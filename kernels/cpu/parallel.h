// A small fork-join thread pool for the kernels. Why not OpenMP: torch ships its own OpenMP runtime,
// and two runtimes spinning on two cores slow each other down; this pool spins only briefly
// (MINDIE_SPIN_US, default 20 us) before it sleeps, and its size is set independently of torch's
// intra-op threads (MINDIE_NUM_THREADS or set_num_threads; default: the hardware threads).
#pragma once

#include <cstdint>
#include <utility>

namespace mindie::kernels::cpu {

void set_num_threads(int n);
int get_num_threads();

using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);

// Runs fn over [0, n) in chunks of `grain` items, the calling thread included; returns when all
// chunks are done. Nested calls (from inside a chunk) run serially on the caller.
void parallel_run(int64_t n, int64_t grain, RangeFn fn, void* ctx);

template <typename F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  using Fn = std::remove_reference_t<F>;
  parallel_run(n, grain < 1 ? 1 : grain,
               [](void* ctx, int64_t b, int64_t e) { (*static_cast<Fn*>(ctx))(b, e); },
               const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace mindie::kernels::cpu
