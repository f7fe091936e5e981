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
#include <stdexcept>
#include <string>
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

// 8 vectors' horizontal sums at once, lane r = hsum(v[r]) bit for bit (its pairs: l + 4, l + 2, l + 1)
inline __m256 hsum8x8(const __m256* v) {
  __m256 s[4], t[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: v[2i][l] + v[2i][l + 4]; lanes 4-7: the same of v[2i + 1]
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // half h: vectors 4i + h and 4i + 2 + h, two partial sums each (l + 2 pairs)
    t[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // half h: vectors h, 2 + h, 4 + h, 6 + h; then back to vector order
  const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

// sum(a[i] * b[i])
#if LOWBIT_AVX512
// A vector's horizontal sum by a fixed tree: lanes l + 8 added, then l + 4, l + 2, l + 1 (GCC's
// _mm512_reduce_add_ps tree, written out so the tiled sum below is the same whatever the compiler).
inline float hsum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// 16 vectors' horizontal sums at once, lane r = hsum16(v[r]) bit for bit (the same pairs added in the same
// order, lanes of several vectors side by side): 46 shuffles and adds for 16 sums, against 7 each alone
inline __m512 hsum16x16(const __m512* v) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i][l] + v[2i][l + 8]; lanes 8-15: the same of v[2i + 1]
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter j: vector 4i + j's l + 4 pairs
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter j: vectors 8i + j and 8i + 4 + j, two partial sums each (l + 2 pairs)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter j: vectors j, 4 + j, 8 + j, 12 + j; then back to vector order
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w);
}

// dot()'s vector part: its 16 lanes before the horizontal sum; *tail: where its scalar tail starts
inline __m512 dot_lanes(const float* a, const float* b, int64_t n, int64_t* tail) {
  int64_t i = 0;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
  *tail = i;
  return _mm512_add_ps(acc0, acc1);
}
#endif

#if LOWBIT_AVX2 && !LOWBIT_AVX512
// dot()'s vector part on AVX2: its 8 lanes before the horizontal sum; *tail: where its scalar tail starts
inline __m256 dot_lanes8(const float* a, const float* b, int64_t n, int64_t* tail) {
  int64_t i = 0;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  *tail = i;
  return _mm256_add_ps(acc0, acc1);
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if LOWBIT_AVX512
  s = hsum16(dot_lanes(a, b, n, &i));
#elif LOWBIT_AVX2
  s = hsum(dot_lanes8(a, b, n, &i));
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
                         const c10::optional<torch::Tensor>& m, const std::string& fmt = "");
// int8 activations (lowbit_i8.cpp)
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows_i8(torch::Tensor x);
torch::Tensor q4_linear_i8(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);
torch::Tensor q8_linear_i8(torch::Tensor x, torch::Tensor qs, torch::Tensor d);
const char* simd_i8();
// GGUF block formats in their own bytes (kquant_cpu.cpp): fmt "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"
torch::Tensor blocks_linear(torch::Tensor x, torch::Tensor w, std::string fmt);
torch::Tensor blocks_dequantize(torch::Tensor w, std::string fmt, int64_t in);
// a decoder layer's pieces (layer_cpu.cpp)
torch::Tensor linear_add(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m,
                         torch::Tensor residual);
torch::Tensor norm_linear(torch::Tensor x, torch::Tensor norm_w, double eps, torch::Tensor qs, torch::Tensor d,
                          c10::optional<torch::Tensor> m);
torch::Tensor mlp(torch::Tensor h, torch::Tensor norm_w, double eps, torch::Tensor gu_qs, torch::Tensor gu_d,
                  c10::optional<torch::Tensor> gu_m, torch::Tensor dn_qs, torch::Tensor dn_d,
                  c10::optional<torch::Tensor> dn_m);
// What a decoder layer computes beyond Llama's (each absent in a Llama layer, the default): Qwen3's and Gemma 3's
// RMSNorms over each head's q and k before RoPE, Gemma 3's on attention's and the MLP's outputs before each residual
// add, its GeGLU, a sliding window; and how each linear's weight is stored where it is a GGUF block format.
struct LayerForm {
  c10::optional<torch::Tensor> q_norm, k_norm;  // fp32 [hd]
  c10::optional<torch::Tensor> attn_out_norm, mlp_out_norm;  // fp32 [D]
  std::string act = "silu";  // the gate's: "silu" or "gelu_pytorch_tanh" (gelu, tanh approximation)
  int64_t window = 0;  // a query at slot s sees only slots > s - window (KVCache.append); 0: every slot
  std::vector<std::string> fmts;  // per linear (qkv, o, gate_up, down): a block format's name, or "" (planes, dense)
};
torch::Tensor decode_layer(torch::Tensor h, torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                           std::vector<torch::Tensor> qkv_w, std::vector<torch::Tensor> o_w,
                           std::vector<torch::Tensor> gu_w, std::vector<torch::Tensor> dn_w, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor kc, torch::Tensor vc, torch::Tensor starts,
                           c10::optional<torch::Tensor> rows, int64_t heads, int64_t kv_heads, double scale,
                           c10::optional<torch::Tensor> tree, const LayerForm& form);

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
