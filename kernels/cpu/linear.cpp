#include "cpu/linear.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu/dispatch.h"
#include "cpu/parallel.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

// One contiguous range of weight rows per thread: a single long stream that the hardware
// prefetcher follows, instead of short scattered tasks that restart it.
template <typename F>
void for_row_ranges(int64_t n, F&& body) {
  const int64_t threads = get_num_threads();
  const int64_t per = ((n + threads - 1) / threads + 15) / 16 * 16;
  parallel_for(threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) body(t * per, std::min(n, (t + 1) * per));
  });
}

template <typename T>
float to_f32(T v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return bf16_to_float(v);
}

// Lane sums of VecF::W partial dot products at once (see reduce_add_w), then bias and store.
template <typename X, typename Wt>
void finish_rows(const LinearArgs& a, VecF* partial, int64_t row, int64_t n0, int count, float* sums) {
  VecF::reduce_add_w(partial, sums);
  X* out = static_cast<X*>(a.out) + row * a.out_stride + n0;
  const Wt* bias = static_cast<const Wt*>(a.bias);
  for (int r = 0; r < count; ++r) {
    const float v = sums[r] + (bias != nullptr ? to_f32(bias[n0 + r]) : 0.f);
    if constexpr (std::is_same_v<X, float>) out[r] = v;
    else out[r] = float_to_bf16(v);
  }
}

// Any dtypes, any variant: x rows converted to float32 once, weights converted as they stream.
template <typename X, typename Wt>
void linear_generic(const LinearArgs& a) {
  constexpr int W = VecF::W;
  const int k = static_cast<int>(a.k);
  std::vector<float> xf(static_cast<size_t>(a.m) * k);
  for (int64_t r = 0; r < a.m; ++r) load_scaled(xf.data() + r * k, static_cast<const X*>(a.x) + r * a.x_stride, 1.f, k);
  const Wt* w = static_cast<const Wt*>(a.weight);
  for_row_ranges(a.n, [&](int64_t begin, int64_t end) {
    VecF partial[W];
    float sums[W];
    for (int64_t n0 = begin; n0 < end; n0 += W) {
      const int count = static_cast<int>(std::min<int64_t>(W, end - n0));
      for (int64_t row = 0; row < a.m; ++row) {
        const float* xr = xf.data() + row * k;
        for (int r = 0; r < W; ++r) {
          VecF acc = VecF::zero();
          if (r < count) {
            const Wt* wr = w + (n0 + r) * k;
            int i = 0;
            for (; i + W <= k; i += W) acc = VecF::fma(VecF::load(xr + i), VecF::load(wr + i), acc);
            if (i < k) acc = VecF::fma(VecF::load_partial(xr + i, k - i), VecF::load_partial(wr + i, k - i), acc);
          }
          partial[r] = acc;
        }
        finish_rows<X, Wt>(a, partial, row, n0, count, sums);
      }
    }
  });
}

#if MINDIE_BF16_DOT
// bf16 x bf16 with vdpbf16ps: exact products, float32 sums, 32 weights per instruction.
void linear_bf16_dot(const LinearArgs& a) {
  const int k = static_cast<int>(a.k);
  const bf16_t* w = static_cast<const bf16_t*>(a.weight);
  const bf16_t* x = static_cast<const bf16_t*>(a.x);
  const __mmask32 tail = static_cast<__mmask32>((k % 32) == 0 ? 0xFFFFFFFFu : (1u << (k % 32)) - 1u);
  for_row_ranges(a.n, [&](int64_t begin, int64_t end) {
    VecF partial[16];
    float sums[16];
    for (int64_t n0 = begin; n0 < end; n0 += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, end - n0));
      for (int64_t row = 0; row < a.m; ++row) {
        const bf16_t* xr = x + row * a.x_stride;
        for (int r = 0; r < 16; ++r) {
          __m512 acc = _mm512_setzero_ps();
          if (r < count) {
            const bf16_t* wr = w + (n0 + r) * k;
            int i = 0;
            for (; i + 32 <= k; i += 32)
              acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(xr + i), (__m512bh)_mm512_loadu_si512(wr + i));
            if (i < k)
              acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, xr + i),
                                     (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + i));
          }
          partial[r] = VecF(acc);
        }
        finish_rows<bf16_t, bf16_t>(a, partial, row, n0, count, sums);
      }
    }
  });
}
#endif

}  // namespace

void linear(const LinearArgs& a) {
  const bool x32 = a.x_dtype == DType::kFloat32, w32 = a.w_dtype == DType::kFloat32;
#if MINDIE_BF16_DOT
  if (!x32 && !w32 && cpu_has_avx512_bf16()) return linear_bf16_dot(a);
#endif
  if (x32 && w32) linear_generic<float, float>(a);
  else if (x32) linear_generic<float, bf16_t>(a);
  else if (w32) linear_generic<bf16_t, float>(a);
  else linear_generic<bf16_t, bf16_t>(a);
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
