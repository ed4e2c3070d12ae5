#include "cpu/layers.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu/parallel.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

template <typename T>
float load1(const T* p) {
  if constexpr (std::is_same_v<T, float>) return *p;
  else return bf16_to_float(*p);
}

template <typename T>
void store1(T* p, float v) {
  if constexpr (std::is_same_v<T, float>) *p = v;
  else *p = float_to_bf16(v);
}

// Rounds through T, as the reference does when it casts back to the activation dtype.
template <typename T>
float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return bf16_to_float(float_to_bf16(v));
}

// Normalises the float row h [n] (x, or x + residual) and writes weight * it to out.
template <typename T, typename Wt>
void norm_row(const float* h, int n, float eps, const Wt* w, T* out) {
  constexpr int W = VecF::W;
  VecF acc = VecF::zero();
  int i = 0;
  for (; i + W <= n; i += W) {
    VecF v = VecF::load(h + i);
    acc = VecF::fma(v, v, acc);
  }
  if (i < n) {
    VecF v = VecF::load_partial(h + i, n - i);
    acc = VecF::fma(v, v, acc);
  }
  const float inv = 1.f / std::sqrt(acc.reduce_add() / static_cast<float>(n) + eps);
  for (int j = 0; j < n; ++j) store1(out + j, round_to<T>(h[j] * inv) * load1(w + j));
}

template <typename T, typename Wt>
void rms_norm_rows(const RmsNormArgs& a) {
  const int n = static_cast<int>(a.hidden);
  parallel_for(a.rows, 16, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;
    buf.resize(n);
    float* h = buf.data();
    const Wt* w = static_cast<const Wt*>(a.weight);
    for (int64_t r = begin; r < end; ++r) {
      const T* x = static_cast<const T*>(a.x) + r * a.x_stride;
      if (a.residual != nullptr) {
        T* res = static_cast<T*>(a.residual) + r * a.residual_stride;
        // The sum is rounded to T, as `x + residual` is in the reference.
        for (int i = 0; i < n; ++i) h[i] = round_to<T>(load1(x + i) + load1(res + i));
        store_scaled(res, h, 1.f, n);
      } else {
        load_scaled(h, x, 1.f, n);
      }
      norm_row(h, n, a.eps, w, static_cast<T*>(a.out) + r * a.out_stride);
    }
  });
}

template <typename T, typename Wt>
void head_norm_rows(const HeadRmsNormArgs& a) {
  const int n = a.head_dim;
  parallel_for(a.tokens * a.heads, 64, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;
    buf.resize(n);
    float* h = buf.data();
    for (int64_t r = begin; r < end; ++r) {
      T* x = static_cast<T*>(a.x) + (r / a.heads) * a.token_stride + (r % a.heads) * n;
      load_scaled(h, x, 1.f, n);
      norm_row(h, n, a.eps, static_cast<const Wt*>(a.weight), x);
    }
  });
}

template <typename T>
void rotate_rows(const RotaryArgs& a) {
  const int half = a.rot_dim / 2;
  parallel_for(a.tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = a.cos_sin + a.positions[t] * a.rot_dim;
      const float* sin = cos + half;
      auto rotate = [&](T* head) {
        for (int i = 0; i < half; ++i) {
          const int i1 = a.neox ? i : 2 * i, i2 = a.neox ? i + half : 2 * i + 1;
          const float x1 = load1(head + i1), x2 = load1(head + i2);
          store1(head + i1, x1 * cos[i] - x2 * sin[i]);
          store1(head + i2, x2 * cos[i] + x1 * sin[i]);
        }
      };
      T* q = static_cast<T*>(a.query) + t * a.q_stride;
      for (int h = 0; h < a.q_heads; ++h) rotate(q + static_cast<int64_t>(h) * a.head_dim);
      T* k = static_cast<T*>(a.key) + t * a.k_stride;
      for (int h = 0; h < a.k_heads; ++h) rotate(k + static_cast<int64_t>(h) * a.head_dim);
    }
  });
}

// Both gates are x * sigmoid(z): silu with z = x, gelu_tanh with z = 2 sqrt(2 / pi) (x + 0.044715 x^3),
// since 0.5 (1 + tanh(y)) = sigmoid(2 y). VecF::exp clamps, so a large -z gives a gate of 0, not NaN.
struct SiluGate {
  static VecF z(VecF x) { return x; }
  static float z(float x) { return x; }
};
struct GeluTanhGate {
  static VecF z(VecF x) { return gelu_tanh_2y(x); }
  static float z(float x) { return gelu_tanh_2y(x); }
};

template <typename Gate, typename T>
void gated_mul_rows(const SiluMulArgs& a) {
  constexpr int W = VecF::W;
  const int n = static_cast<int>(a.inter);
  parallel_for(a.tokens, 4, [&](int64_t begin, int64_t end) {
    const VecF one = VecF::set1(1.f), zero = VecF::zero();
    for (int64_t t = begin; t < end; ++t) {
      const T* g = static_cast<const T*>(a.x) + t * a.x_stride;
      const T* u = g + n;
      T* out = static_cast<T*>(a.out) + t * a.out_stride;
      int i = 0;
      for (; i + W <= n; i += W) {
        VecF x = VecF::load(g + i);
        (x / (one + VecF::exp(zero - Gate::z(x))) * VecF::load(u + i)).store(out + i);
      }
      for (; i < n; ++i) {
        const float x = load1(g + i);
        store1(out + i, x / (1.f + std::exp(std::min(-Gate::z(x), 88.7f))) * load1(u + i));
      }
    }
  });
}

}  // namespace

void rms_norm(const RmsNormArgs& a) {
  const bool w32 = a.weight_dtype == DType::kFloat32;
  if (a.dtype == DType::kFloat32) w32 ? rms_norm_rows<float, float>(a) : rms_norm_rows<float, bf16_t>(a);
  else w32 ? rms_norm_rows<bf16_t, float>(a) : rms_norm_rows<bf16_t, bf16_t>(a);
}

void head_rms_norm(const HeadRmsNormArgs& a) {
  const bool w32 = a.weight_dtype == DType::kFloat32;
  if (a.dtype == DType::kFloat32) w32 ? head_norm_rows<float, float>(a) : head_norm_rows<float, bf16_t>(a);
  else w32 ? head_norm_rows<bf16_t, float>(a) : head_norm_rows<bf16_t, bf16_t>(a);
}

void rotary_embedding(const RotaryArgs& a) {
  a.dtype == DType::kFloat32 ? rotate_rows<float>(a) : rotate_rows<bf16_t>(a);
}

void silu_and_mul(const SiluMulArgs& a) {
  a.dtype == DType::kFloat32 ? gated_mul_rows<SiluGate, float>(a) : gated_mul_rows<SiluGate, bf16_t>(a);
}

void gelu_tanh_and_mul(const SiluMulArgs& a) {
  a.dtype == DType::kFloat32 ? gated_mul_rows<GeluTanhGate, float>(a) : gated_mul_rows<GeluTanhGate, bf16_t>(a);
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
