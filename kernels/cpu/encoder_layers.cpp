#include "cpu/encoder_layers.h"

#include <cmath>

#include "cpu/parallel.h"
#include "cpu/types.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

constexpr int W = VecF::W;

// Applies f to every W-wide piece of [0, n), the last one partial.
template <typename F>
void for_each_piece(int n, F&& f) {
  int i = 0;
  for (; i + W <= n; i += W) f(i, W);
  if (i < n) f(i, n - i);
}

template <typename T>
VecF load_n(const T* p, int n) { return n == W ? VecF::load(p) : VecF::load_partial(p, n); }

template <typename T>
void store_n(VecF v, T* p, int n) { n == W ? v.store(p) : v.store_partial(p, n); }

// out = (h - mean) / sqrt(var + eps) * w + b for the float row h. Two passes over h (mean, then the
// squared deviations) as torch's float accumulation does, not E[h^2] - mean^2, which cancels.
template <typename T, typename Wt>
void norm_row(const float* h, int n, float eps, const Wt* w, const Wt* b, T* out) {
  VecF acc = VecF::zero();
  for_each_piece(n, [&](int i, int k) { acc = acc + load_n(h + i, k); });
  const float mean = acc.reduce_add() / static_cast<float>(n);
  const VecF m = VecF::set1(mean);
  acc = VecF::zero();
  for_each_piece(n, [&](int i, int k) {
    // the partial piece's missing lanes load as mean: zero deviation
    const VecF d = (k == W ? VecF::load(h + i) : VecF::load_partial(h + i, k, mean)) - m;
    acc = VecF::fma(d, d, acc);
  });
  const VecF rstd = VecF::set1(1.f / std::sqrt(acc.reduce_add() / static_cast<float>(n) + eps));
  for_each_piece(n, [&](int i, int k) {
    store_n(VecF::fma((load_n(h + i, k) - m) * rstd, load_n(w + i, k), load_n(b + i, k)), out + i, k);
  });
}

template <typename T, typename Wt>
void layer_norm_rows(const LayerNormArgs& args) {
  const RmsNormArgs& a = args.norm;
  const int n = static_cast<int>(a.hidden);
  parallel_for(a.rows, 16, [&](int64_t begin, int64_t end) {
    thread_local ScratchVector<float> buf;
    float* h = sized(buf, n);
    for (int64_t r = begin; r < end; ++r) {
      const T* x = static_cast<const T*>(a.x) + r * a.x_stride;
      if (a.residual != nullptr) {
        T* res = static_cast<T*>(a.residual) + r * a.residual_stride;
        // The sum is stored in T first and normalised as stored, as `residual + x` then the norm
        // are in the reference.
        for_each_piece(n, [&](int i, int k) {
          store_n(load_n(res + i, k) + load_n(x + i, k), res + i, k);
          store_n(load_n(res + i, k), h + i, k);
        });
      } else {
        load_scaled(h, x, 1.f, n);
      }
      norm_row(h, n, a.eps, static_cast<const Wt*>(a.weight), static_cast<const Wt*>(args.bias),
               static_cast<T*>(a.out) + r * a.out_stride);
    }
  });
}

template <typename T>
void gelu_tanh_rows(const GeluArgs& a) {
  const int n = static_cast<int>(a.n);
  parallel_for(a.rows, 4, [&](int64_t begin, int64_t end) {
    const VecF one = VecF::set1(1.f), zero = VecF::zero();
    for (int64_t r = begin; r < end; ++r) {
      const T* x = static_cast<const T*>(a.x) + r * a.x_stride;
      T* out = static_cast<T*>(a.out) + r * a.out_stride;
      for_each_piece(n, [&](int i, int k) {
        const VecF v = load_n(x + i, k);
        store_n(v / (one + VecF::exp(zero - gelu_tanh_2y(v))), out + i, k);
      });
    }
  });
}

}  // namespace

void layer_norm(const LayerNormArgs& a) {
  const bool w32 = a.norm.weight_dtype == DType::kFloat32;
  if (a.norm.dtype == DType::kFloat32) w32 ? layer_norm_rows<float, float>(a) : layer_norm_rows<float, bf16_t>(a);
  else w32 ? layer_norm_rows<bf16_t, float>(a) : layer_norm_rows<bf16_t, bf16_t>(a);
}

void gelu_tanh(const GeluArgs& a) {
  a.dtype == DType::kFloat32 ? gelu_tanh_rows<float>(a) : gelu_tanh_rows<bf16_t>(a);
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
