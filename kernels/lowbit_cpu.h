// Declarations shared by the CPU kernel's sources (lowbit_cpu.cpp: the fp32 / bf16 GEMV and the module;
// lowbit_i8.cpp: int8 activations; layer_cpu.cpp: a decoder layer's pieces), and the SIMD level the build has.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LOWBIT_AVX2 1
#else
#define LOWBIT_AVX2 0
#endif
#if LOWBIT_AVX2 && defined(__AVX512F__)
#define LOWBIT_AVX512 1
#else
#define LOWBIT_AVX512 0
#endif

constexpr int64_t QK = 32;  // weights per block

inline float h2f(const at::Half h) {
#if LOWBIT_AVX2
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

inline void check(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, int64_t bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous fp32 [B, I]");
  const int64_t in = x.size(1);
  TORCH_CHECK(in % QK == 0, "in_features ", in, " is not a multiple of ", QK);
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == in / QK * bytes_per_block,
              "qs must be contiguous [O, ", in / QK * bytes_per_block, "], got ", qs.sizes());
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kHalf && d.is_contiguous() && d.size(0) == qs.size(0) &&
                  d.size(1) == in / QK,
              "scales must be contiguous fp16 [O, I/32]");
}

#if LOWBIT_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
#endif

// sum(a[i] * b[i])
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if LOWBIT_AVX512
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
  s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif LOWBIT_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// g fp16 numbers into fp32 (sixteen or eight at a time)
inline void halves_to_f32(const at::Half* h, int64_t g, float* out) {
  int64_t k = 0;
#if LOWBIT_AVX512
  for (; k + 16 <= g; k += 16)
    _mm512_storeu_ps(out + k, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + k))));
#elif LOWBIT_AVX2
  for (; k + 8 <= g; k += 8)
    _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + k))));
#endif
  for (; k < g; ++k) out[k] = h2f(h[k]);
}

// fp32 activations (lowbit_cpu.cpp)
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d);
torch::Tensor linear_any(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                         const c10::optional<torch::Tensor>& m);
// int8 activations (lowbit_i8.cpp)
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows_i8(torch::Tensor x);
torch::Tensor q4_linear_i8(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);
torch::Tensor q8_linear_i8(torch::Tensor x, torch::Tensor qs, torch::Tensor d);
const char* simd_i8();
// a decoder layer's pieces (layer_cpu.cpp)
torch::Tensor linear_add(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m,
                         torch::Tensor residual);
torch::Tensor norm_linear(torch::Tensor x, torch::Tensor norm_w, double eps, torch::Tensor qs, torch::Tensor d,
                          c10::optional<torch::Tensor> m);
torch::Tensor mlp(torch::Tensor h, torch::Tensor norm_w, double eps, torch::Tensor gu_qs, torch::Tensor gu_d,
                  c10::optional<torch::Tensor> gu_m, torch::Tensor dn_qs, torch::Tensor dn_d,
                  c10::optional<torch::Tensor> dn_m);
torch::Tensor decode_layer(torch::Tensor h, torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                           std::vector<torch::Tensor> qkv_w, std::vector<torch::Tensor> o_w,
                           std::vector<torch::Tensor> gu_w, std::vector<torch::Tensor> dn_w, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor kc, torch::Tensor vc, torch::Tensor starts,
                           c10::optional<torch::Tensor> rows, int64_t heads, int64_t kv_heads, double scale,
                           c10::optional<torch::Tensor> tree);

// Every decoder layer of a model in one call (decode_layer for each, no return to Python between layers):
// the layers' norms and weight planes bound once, the cache's K/V as [L, B, Hkv, S, hd], every layer of a row
// at the same length (starts [N]; rows [N]: the batch rows' cache rows).
struct LayerStack {
  std::vector<torch::Tensor> in_norms, post_norms;
  std::vector<std::vector<torch::Tensor>> qkv, o, gate_up, down;
  double eps, scale;
  int64_t heads, kv_heads;
  torch::Tensor forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v,
                        torch::Tensor starts, c10::optional<torch::Tensor> rows,
                        c10::optional<torch::Tensor> tree) const;
};
