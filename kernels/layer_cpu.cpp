// A decoder layer's pieces on CPU, fp32: norm + qkv, o + residual, the whole MLP, and a whole layer for one
// new token per row. At decode sizes the ops between the GEMVs (RMSNorm over 576 numbers, RoPE, attention
// for one query over a few hundred keys, SiLU) are microseconds of arithmetic; as ATen ops each cost
// a dispatch, an allocation and often a parallel region, which added up to about 40% of a batch-1 layer.
// Here they are plain loops over raw pointers, vectorized by hand (AVX-512 / AVX2, a scalar loop elsewhere).
// The numbers agree with the ATen ops up to fp32 reassociation (tests/test_quant.py compares them).
#pragma once  // included by lowbit_cpu.cpp, the one translation unit
#include "lowbit_cpu.h"

#include <limits>

namespace {

// ---- vector helpers (dot in lowbit_cpu.h): y += a * x, exp (Cephes' polynomial, within 2 ulp of expf)
inline void axpy(float* y, float a, const float* x, int64_t n) {
  int64_t i = 0;
#if LOWBIT_AVX512
  const __m512 va = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif LOWBIT_AVX2
  const __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

// exp(x) = 2^k * p(r), k = round(x / ln 2), r = x - k ln 2 (in two parts), p Cephes' degree-6 polynomial;
// x clamped to [-87.3, 88.3] (exp(-87.3) ~ 1e-38 stands in for 0 in a softmax or a SiLU)
constexpr float EXP_HI = 88.3762626647949f, EXP_LO = -87.3365447504f, LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

inline float exp_scalar(float x) {
  x = std::min(std::max(x, EXP_LO), EXP_HI);
  const float k = std::nearbyint(x * LOG2E);
  const float r = (x - k * LN2_HI) - k * LN2_LO;
  float p = P0;
  for (float c : {P1, P2, P3, P4, P5}) p = p * r + c;
  return std::ldexp(p * r * r + r + 1.f, static_cast<int>(k));
}

#if LOWBIT_AVX512
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
  const __m512 k =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(LN2_HI))),
                                 _mm512_mul_ps(k, _mm512_set1_ps(LN2_LO)));
  __m512 p = _mm512_set1_ps(P0);
  for (float c : {P1, P2, P3, P4, P5}) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}
#elif LOWBIT_AVX2
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
  const __m256 k =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(LN2_HI))),
                                 _mm256_mul_ps(k, _mm256_set1_ps(LN2_LO)));
  __m256 p = _mm256_set1_ps(P0);
  for (float c : {P1, P2, P3, P4, P5}) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));  // k in [-126, 127]: 2^k is a normal float
}
#endif

// y[i] = exp(x[i] - shift), 0 where x[i] - shift < floor; returns the sum of y. A softmax's floor: a weight
// under e^-64 (1.6e-28 of the largest) is below fp32's resolution of the sum, and kept it makes denormal products
// against V (e^-87 is the clamp's 1.2e-38) that cost a microcode assist each: a query whose score on one key is far
// above the others' (an attention sink) ran far slower for it
inline float exp_shifted(const float* x, float shift, float* y, int64_t n,
                         float floor = -std::numeric_limits<float>::infinity()) {
  int64_t i = 0;
  float s = 0.f;
#if LOWBIT_AVX512
  __m512 acc = _mm512_setzero_ps();
  const __m512 lo = _mm512_set1_ps(floor);
  for (; i + 16 <= n; i += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(shift));
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, lo, _CMP_GE_OQ), exp512(d));
    _mm512_storeu_ps(y + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  s = _mm512_reduce_add_ps(acc);
#elif LOWBIT_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 lo = _mm256_set1_ps(floor);
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(shift));
    const __m256 e = _mm256_and_ps(_mm256_cmp_ps(d, lo, _CMP_GE_OQ), exp256(d));
    _mm256_storeu_ps(y + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  s = hsum(acc);
#endif
  for (; i < n; ++i) {
    const float d = x[i] - shift;
    s += (y[i] = d >= floor ? exp_scalar(d) : 0.f);
  }
  return s;
}

// act[r, i] = silu(gu[r, i]) * gu[r, I + i] = g / (1 + exp(-g)) * u, gu [rows, 2I]
void silu_mul(const float* gu, float* act, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* a = act + r * inter;
    int64_t i = 0;
#if LOWBIT_AVX512
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= inter; i += 16) {
      const __m512 vg = _mm512_loadu_ps(g + i);
      const __m512 den = _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), vg)));
      _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_div_ps(vg, den), _mm512_loadu_ps(u + i)));
    }
#elif LOWBIT_AVX2
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= inter; i += 8) {
      const __m256 vg = _mm256_loadu_ps(g + i);
      const __m256 den = _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), vg)));
      _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(vg, den), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; ++i) a[i] = g[i] / (1.f + exp_scalar(-g[i])) * u[i];
  }
}

// tanh as Cephes' tanhf computes it: an odd polynomial for |x| < 0.625, 1 - 2 / (exp(2|x|) + 1) above (exp clamped
// at 88.3: tanh is 1 in fp32 long before); within 2 ulp of tanh, as torch's (Sleef's) is within 1
constexpr float TANH_SMALL = 0.625f, T0 = -5.70498872745e-3f, T1 = 2.06390887954e-2f, T2 = -5.37397155531e-2f,
                T3 = 1.33314422036e-1f, T4 = -3.33332819422e-1f;

inline float tanh_scalar(float x) {
  const float z = std::fabs(x);
  if (z >= TANH_SMALL) {
    const float r = 1.f - 2.f / (exp_scalar(z + z) + 1.f);
    return x < 0.f ? -r : r;
  }
  const float z2 = x * x;
  return ((((T0 * z2 + T1) * z2 + T2) * z2 + T3) * z2 + T4) * z2 * x + x;
}

#if LOWBIT_AVX512
inline __m512 tanh512(__m512 x) {
  const __m512 sign = _mm512_set1_ps(-0.f), one = _mm512_set1_ps(1.f);
  const __m512 z = _mm512_andnot_ps(sign, x), z2 = _mm512_mul_ps(x, x);
  const __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(exp512(_mm512_add_ps(z, z)), one)));
  __m512 p = _mm512_set1_ps(T0);
  for (float c : {T1, T2, T3, T4}) p = _mm512_add_ps(_mm512_mul_ps(p, z2), _mm512_set1_ps(c));
  const __m512 small = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, z2), x), x);
  const __m512 signed_big = _mm512_or_ps(big, _mm512_and_ps(sign, x));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_set1_ps(TANH_SMALL), _CMP_GE_OQ), small, signed_big);
}
#elif LOWBIT_AVX2
inline __m256 tanh256(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  const __m256 z = _mm256_andnot_ps(sign, x), z2 = _mm256_mul_ps(x, x);
  const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(exp256(_mm256_add_ps(z, z)), one)));
  __m256 p = _mm256_set1_ps(T0);
  for (float c : {T1, T2, T3, T4}) p = _mm256_add_ps(_mm256_mul_ps(p, z2), _mm256_set1_ps(c));
  const __m256 small = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, z2), x), x);
  const __m256 signed_big = _mm256_or_ps(big, _mm256_and_ps(sign, x));
  return _mm256_blendv_ps(small, signed_big, _mm256_cmp_ps(z, _mm256_set1_ps(TANH_SMALL), _CMP_GE_OQ));
}
#endif

// act[r, i] = gelu_tanh(gu[r, i]) * gu[r, I + i], gu [rows, 2I]; gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi)
// (g + 0.044715 g^3))), each op in the order torch's F.gelu(approximate="tanh") computes it
constexpr float GELU_BETA = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), GELU_KAPPA = 0.044715f;

void gelu_tanh_mul(const float* gu, float* act, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* a = act + r * inter;
    int64_t i = 0;
#if LOWBIT_AVX512
    const __m512 beta = _mm512_set1_ps(GELU_BETA), kappa = _mm512_set1_ps(GELU_KAPPA), half = _mm512_set1_ps(0.5f),
                 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= inter; i += 16) {
      const __m512 x = _mm512_loadu_ps(g + i);
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, cube)));
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, tanh512(inner)));
      _mm512_storeu_ps(a + i, _mm512_mul_ps(y, _mm512_loadu_ps(u + i)));
    }
#elif LOWBIT_AVX2
    const __m256 beta = _mm256_set1_ps(GELU_BETA), kappa = _mm256_set1_ps(GELU_KAPPA), half = _mm256_set1_ps(0.5f),
                 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= inter; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      const __m256 inner = _mm256_mul_ps(beta, _mm256_add_ps(x, _mm256_mul_ps(kappa, cube)));
      const __m256 y = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh256(inner)));
      _mm256_storeu_ps(a + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; ++i) {
      const float x = g[i], inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x));
      a[i] = 0.5f * x * (1.f + tanh_scalar(inner)) * u[i];
    }
  }
}

// y[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w, as torch's rms_norm computes it
void rms_norm_rows(const float* x, const float* w, float eps, float* y, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float* yr = y + r * d;
    const float inv = 1.f / std::sqrt(dot(xr, xr, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) yr[i] = (xr[i] * inv) * w[i];
  }
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous fp32 [B, D]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1),
              "norm weight must be fp32 [D]");
  auto y = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), y.data_ptr<float>(), x.size(0),
                x.size(1));
  return y;
}

constexpr float SOFTMAX_FLOOR = -64.f;  // see exp_shifted

// A query's softmax numerators in place: p holds its scores over the s0 cached keys and the chunk's t (those it
// sees(i); the others become 0), mx their largest; exp(p - mx), 0 under the floor. Returns their sum, in the order
// both attention paths keep.
template <class Sees>
inline float softmax_numerators(float* p, int64_t s0, int64_t t, float mx, Sees sees) {
  float sum = exp_shifted(p, mx, p, s0, SOFTMAX_FLOOR);
  for (int64_t i = 0; i < t; ++i)
    sum += (p[s0 + i] = sees(i) && p[s0 + i] - mx >= SOFTMAX_FLOOR ? exp_scalar(p[s0 + i] - mx) : 0.f);
  return sum;
}

// A sliding window over a chunk of T tokens per row (KVCache.append's rule): a query at position p sees only keys
// at positions > p - window, a token's position its row's start plus its depth (its index in a causal chunk; in a
// tree, the ancestors it sees, tree[r, j, :], less one). window 0: every key.
struct Window {
  int64_t window, t;
  std::vector<int64_t> depth;  // [N T]

  Window(int64_t window, const bool* tree, int64_t n, int64_t t) : window(window), t(t), depth(n * t) {
    for (int64_t row = 0; row < n * t; ++row)
      depth[row] = tree == nullptr ? row % t : std::count(tree + row * t, tree + (row + 1) * t, true) - 1;
  }
  // the first cached slot query (r, j) sees
  int64_t first(int64_t r, int64_t j, int64_t start) const {
    return window > 0 ? std::min(start, std::max<int64_t>(0, start + depth[r * t + j] - window + 1)) : 0;
  }
  // whether query (r, j) is within the window of the chunk's token i (its tree or causal rule aside)
  bool sees(int64_t r, int64_t j, int64_t i) const {
    return window <= 0 || depth[r * t + i] > depth[r * t + j] - window;
  }
};

// attend takes its grouped path where it applies (tests turn it off to compare the two: grouped_attention())
std::atomic<bool> grouped_attention_on{true};

#if LOWBIT_AVX512
// 16 x 16 fp32 transpose in registers: r[i] element j -> r[j] element i
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
  }
}

// The G queries of one row that share a K/V head (its heads x the chunk's tokens; q[g], out[g] [16 C]) over the
// row's s0 cached keys and the chunk's t (query g sees chunk key i where vis[g t + i]). Scores 16 keys at a time
// against the keys transposed (broadcast FMAs, no horizontal sum per key), then P V with each query's output in
// registers while V streams by once (a key no query of the tile weighs is skipped). Every sum in the order of
// attend's loop (dot(), its reduction tree, the softmax, the axpy of normalized weights): the same bits, faster.
// Query g sees the cached keys from cut[g] on (a sliding window; 0: all). p: [G, s0 + t] scratch; kt: [16 C, 16].
template <int C>
void attend_group(const float* const* q, float* const* out, int64_t G, const float* K, const float* V, int64_t s_t,
                  int64_t s0, int64_t t, const uint8_t* vis, const int64_t* cut, float scale, float* p, float* inv,
                  float* kt) {
  constexpr int64_t HD = 16 * C;
  constexpr int TQ = C <= 4 ? 4 : C <= 8 ? 2 : 1;  // queries a tile: TQ x C accumulators
  const int64_t L = s0 + t;
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t x0 = 0;
  for (; x0 + 16 <= s0; x0 += 16) {
    for (int c = 0; c < C; ++c) {
      __m512 r[16];
      for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_ps(K + (x0 + k) * s_t + 16 * c);
      transpose16(r);
      for (int d = 0; d < 16; ++d) _mm512_storeu_ps(kt + (16 * c + d) * 16, r[d]);
    }
    for (int64_t g = 0; g < G; ++g) {  // dot()'s sums in dot()'s order, 16 keys in the lanes
      const float* qg = q[g];
      __m512 v[16];
      for (int l = 0; l < 16; ++l) {
        __m512 acc[2];
        for (int c = 0; c < C; ++c) {
          const int64_t d = 16 * c + l;
          const __m512 prod = _mm512_set1_ps(qg[d]);
          acc[c % 2] = c < 2 ? _mm512_mul_ps(prod, _mm512_loadu_ps(kt + d * 16))
                             : _mm512_fmadd_ps(prod, _mm512_loadu_ps(kt + d * 16), acc[c % 2]);
        }
        v[l] = C > 1 ? _mm512_add_ps(acc[0], acc[1]) : acc[0];
      }
      // _mm512_reduce_add_ps's tree: lanes l + 8, then + 4, then + 2, then + 1
      for (int l = 0; l < 8; ++l) v[l] = _mm512_add_ps(v[l + 8], v[l]);
      for (int l = 0; l < 4; ++l) v[l] = _mm512_add_ps(v[l + 4], v[l]);
      for (int l = 0; l < 2; ++l) v[l] = _mm512_add_ps(v[l], v[l + 2]);
      _mm512_storeu_ps(p + g * L + x0, _mm512_mul_ps(_mm512_add_ps(v[0], v[1]), vscale));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p + g * L;
    for (int64_t x = x0; x < s0; ++x) pg[x] = dot(q[g], K + x * s_t, HD) * scale;
    std::fill(pg, pg + cut[g], -std::numeric_limits<float>::infinity());  // under the floor: weight 0
    for (int64_t i = 0; i < t; ++i)
      pg[s0 + i] = vis[g * t + i] ? dot(q[g], K + (s0 + i) * s_t, HD) * scale
                                  : -std::numeric_limits<float>::infinity();
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t x = 0; x < L; ++x) mx = std::max(mx, pg[x]);
    inv[g] = 1.f / softmax_numerators(pg, s0, t, mx, [&](int64_t i) { return vis[g * t + i] != 0; });
  }
  for (int64_t g0 = 0; g0 < G; g0 += TQ) {
    const int nq = static_cast<int>(std::min<int64_t>(TQ, G - g0));
    __m512 acc[TQ][C];
    for (int i = 0; i < TQ; ++i)
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t x = 0; x < L; ++x) {
      bool any = false;
      for (int i = 0; i < nq; ++i) any |= p[(g0 + i) * L + x] != 0.f;
      if (!any) continue;
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(V + x * s_t + 16 * c);
      for (int i = 0; i < TQ; ++i) {
        if (i >= nq) break;
        const __m512 w = _mm512_set1_ps(p[(g0 + i) * L + x] * inv[g0 + i]);  // normalized first, as attend
        for (int c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(w, v[c], acc[i][c]);
      }
    }
    for (int i = 0; i < nq; ++i)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[g0 + i] + 16 * c, acc[i][c]);
  }
}

// attend, by (row, K/V head): hd 32, 64 or 128; false where it does not apply (then attend's own loop runs). The
// group's cached keys from the first any of its queries sees (see window_of), each query's own first cut from it.
bool attend_grouped(const float* q, const float* kc, const float* vc, const bool* tree, float* o, const int64_t* start,
                    const int64_t* cr, int64_t n, int64_t t, int64_t heads, int64_t kv_heads, int64_t s_n,
                    int64_t s_h, int64_t s_t, int64_t hd, float scale, const Window& win) {
  if ((hd != 32 && hd != 64 && hd != 128) || !grouped_attention_on) return false;
  const int64_t group = heads / kv_heads, G = group * t, longest = *std::max_element(start, start + n) + t;
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> p(G * longest), inv(G), kt(hd * 16);
    std::vector<const float*> qp(G);
    std::vector<float*> op(G);
    std::vector<uint8_t> vis(G * t);
    std::vector<int64_t> cut(G);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b / kv_heads, kvh = b % kv_heads;
      int64_t base = start[r];
      for (int64_t j = 0; j < t; ++j) base = std::min(base, win.first(r, j, start[r]));
      for (int64_t j = 0; j < t; ++j)
        for (int64_t hh = 0; hh < group; ++hh) {
          const int64_t g = j * group + hh, row = (r * t + j) * heads + kvh * group + hh;
          qp[g] = q + row * hd;
          op[g] = o + row * hd;
          cut[g] = win.first(r, j, start[r]) - base;
          for (int64_t i = 0; i < t; ++i)
            vis[g * t + i] = (tree != nullptr ? tree[(r * t + j) * t + i] : i <= j) && win.sees(r, j, i);
        }
      const float* K = kc + cr[r] * s_n + kvh * s_h + base * s_t;
      const float* V = vc + cr[r] * s_n + kvh * s_h + base * s_t;
      const int64_t s0 = start[r] - base;
      if (hd == 32)
        attend_group<2>(qp.data(), op.data(), G, K, V, s_t, s0, t, vis.data(), cut.data(), scale, p.data(), inv.data(),
                        kt.data());
      else if (hd == 64)
        attend_group<4>(qp.data(), op.data(), G, K, V, s_t, s0, t, vis.data(), cut.data(), scale, p.data(), inv.data(),
                        kt.data());
      else
        attend_group<8>(qp.data(), op.data(), G, K, V, s_t, s0, t, vis.data(), cut.data(), scale, p.data(), inv.data(),
                        kt.data());
    }
  });
  return true;
}
#endif

// Attention for T new tokens per row r written at slots [start[r], start[r] + T) of its cache row cr[r]: query
// (row r, token j, head h) sees slots [0, start[r]) and the chunk's slots start[r] + i that tree[r, j, i] marks
// (nullptr: i <= j, a causal chunk), within the sliding window where window > 0 (Window). o = softmax(scale * q K^T)
// V over what it sees. GQA: heads / kv_heads query heads share a K/V head. q, o [N T, H, hd]; K, V strided
// [B, Hkv, S, hd] (s_* the strides of B, Hkv, S).
void attend(const float* q, const float* kc, const float* vc, const bool* tree, float* o, const int64_t* start,
            const int64_t* cr, int64_t n, int64_t t, int64_t heads, int64_t kv_heads, int64_t s_n, int64_t s_h,
            int64_t s_t, int64_t hd, float scale, int64_t window = 0) {
  const Window win(window, tree, n, t);
#if LOWBIT_AVX512
  if (attend_grouped(q, kc, vc, tree, o, start, cr, n, t, heads, kv_heads, s_n, s_h, s_t, hd, scale, win)) return;
#endif
  const int64_t group = heads / kv_heads, longest = *std::max_element(start, start + n) + t;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, longest * hd));  // ~32k multiply-adds a task
  at::parallel_for(0, n * t * heads, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> p(longest);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t row = b / heads, r = row / t, j = row % t, kvh = (b % heads) / group;
      const int64_t first = win.first(r, j, start[r]), s0 = start[r] - first;  // the cached keys it sees
      const float* qb = q + b * hd;
      const float* K = kc + cr[r] * s_n + kvh * s_h + first * s_t;
      const float* V = vc + cr[r] * s_n + kvh * s_h + first * s_t;
      auto sees = [&](int64_t i) { return (tree != nullptr ? tree[row * t + i] : i <= j) && win.sees(r, j, i); };
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t x = 0; x < s0; ++x) mx = std::max(mx, p[x] = dot(qb, K + x * s_t, hd) * scale);
      for (int64_t i = 0; i < t; ++i)
        if (sees(i)) mx = std::max(mx, p[s0 + i] = dot(qb, K + (s0 + i) * s_t, hd) * scale);
      const float inv = 1.f / softmax_numerators(p.data(), s0, t, mx, sees);
      float* ob = o + b * hd;
      std::fill(ob, ob + hd, 0.f);
      for (int64_t x = 0; x < s0 + t; ++x)
        if (p[x] != 0.f) axpy(ob, p[x] * inv, V + x * s_t, hd);
    }
  });
}

// One linear's weight as decode_layer takes it: (qs, d) Q8_0 / (qs, d, m) Q4_1 planes, (w) a dense matrix, or (w)
// a GGUF block format's bytes, fmt its name
struct LinearWeight {
  torch::Tensor qs, d;  // d undefined: a dense matrix or blocks
  c10::optional<torch::Tensor> m;
  std::string fmt;

  torch::Tensor operator()(const torch::Tensor& x) const { return linear_any(x, qs, d, m, fmt); }
};

LinearWeight weight_of(const std::vector<torch::Tensor>& w, const std::string& fmt = "") {
  TORCH_CHECK(w.size() >= 1 && w.size() <= 3, "weight planes are (qs, d), (qs, d, m) or a dense matrix (w)");
  TORCH_CHECK(fmt.empty() || w.size() == 1, "a block format's weight is its bytes alone");
  if (w.size() == 1) return {w[0], torch::Tensor(), c10::nullopt, fmt};
  return {w[0], w[1], w.size() == 3 ? c10::optional<torch::Tensor>(w[2]) : c10::nullopt, ""};
}

}  // namespace

// residual + x @ W^T (o_proj, down_proj)
torch::Tensor linear_add(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m,
                         torch::Tensor residual) {
  return linear_any(x, qs, d, m).add_(residual);
}

// rms_norm(x) * norm_w, then @ W^T (the qkv projection)
torch::Tensor norm_linear(torch::Tensor x, torch::Tensor norm_w, double eps, torch::Tensor qs, torch::Tensor d,
                          c10::optional<torch::Tensor> m) {
  return linear_any(rms_norm(x, norm_w, eps), qs, d, m);
}

// h + down(silu(gate) * up) with (gate, up) = gate_up(rms_norm(h) * norm_w): the whole MLP half of a layer
torch::Tensor mlp(torch::Tensor h, torch::Tensor norm_w, double eps, torch::Tensor gu_qs, torch::Tensor gu_d,
                  c10::optional<torch::Tensor> gu_m, torch::Tensor dn_qs, torch::Tensor dn_d,
                  c10::optional<torch::Tensor> dn_m) {
  auto gu = norm_linear(h, norm_w, eps, gu_qs, gu_d, gu_m);  // [B, 2I]
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  auto act = torch::empty({rows, inter}, gu.options());
  silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), rows, inter);
  return linear_add(act, dn_qs, dn_d, dn_m, h);
}

namespace {

// A chunk's place in the cache (decode_layer's arguments checked once): n rows of t tokens, row r's at slots
// [start[r], start[r] + t) of cache row cache_rows[r]; the tree's bool [N, T, T] or nullptr
struct Slots {
  int64_t n, t, m, hd;
  std::vector<int64_t> cache_rows;
  const int64_t* start;
  const bool* tree;
};

Slots check_slots(const torch::Tensor& h, torch::Tensor& cos, torch::Tensor& sin, const torch::Tensor& kc,
                  const torch::Tensor& vc, const torch::Tensor& starts, const c10::optional<torch::Tensor>& rows,
                  int64_t heads, int64_t kv_heads, const c10::optional<torch::Tensor>& tree) {
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == at::kLong && starts.is_contiguous() && starts.is_cpu(),
              "starts must be a contiguous int64 [N] on the CPU");
  Slots sl{starts.size(0), 0, h.size(0), kc.size(3), {}, starts.data_ptr<int64_t>(), nullptr};
  sl.t = sl.m / std::max<int64_t>(sl.n, 1);
  TORCH_CHECK(kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.stride(3) == 1 &&
                  vc.stride(3) == 1 && kc.strides() == vc.strides() && kc.sizes() == vc.sizes() &&
                  kc.size(1) == kv_heads,
              "the K/V slots must be fp32 [B, Hkv, S, hd] with unit stride over hd");
  TORCH_CHECK(sl.n >= 1 && sl.t >= 1 && sl.m == sl.n * sl.t, "h has ", sl.m, " rows: not T tokens for each of ",
              sl.n, " rows");
  sl.cache_rows.resize(sl.n);
  for (int64_t r = 0; r < sl.n; ++r) sl.cache_rows[r] = r;
  if (rows.has_value()) {
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == sl.n && rows->scalar_type() == at::kLong && rows->is_cpu(),
                "rows must be int64 [N] on the CPU");
    std::copy(rows->data_ptr<int64_t>(), rows->data_ptr<int64_t>() + sl.n, sl.cache_rows.begin());
  }
  for (int64_t r = 0; r < sl.n; ++r) {
    TORCH_CHECK(sl.cache_rows[r] >= 0 && sl.cache_rows[r] < kc.size(0), "cache row ", sl.cache_rows[r],
                " is out of range");
    TORCH_CHECK(sl.start[r] >= 0 && sl.start[r] + sl.t <= kc.size(2), "slots ", sl.start[r], "..",
                sl.start[r] + sl.t, " are past the cache's ", kc.size(2));
  }
  cos = cos.contiguous();  // a batch of one may come as a broadcast view
  sin = sin.contiguous();
  TORCH_CHECK(cos.numel() == sl.m * sl.hd && sin.numel() == sl.m * sl.hd && cos.scalar_type() == h.scalar_type() &&
                  sin.scalar_type() == h.scalar_type(),
              "cos, sin must be [N, 1, T, hd] in h's dtype");
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  if (tree.has_value()) {
    TORCH_CHECK(tree->scalar_type() == at::kBool && tree->is_contiguous() && tree->numel() == sl.n * sl.t * sl.t,
                "tree must be a contiguous bool [N, T, T]");
    sl.tree = tree->data_ptr<bool>();
  }
  return sl;
}

constexpr int64_t ROW_GRAIN = 8;  // rows a thread takes of a layer's elementwise loops

// bf16 as ATen rounds a finite fp32 (to nearest, ties to even: c10::BFloat16's rule), kept in fp32: branch-free,
// so the loops below vectorize. Each bf16 ATen op computes in fp32 and rounds its result once.
inline float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &u, 4);
  return x;
}
inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
inline uint16_t float_to_bf16_bits(float x) {  // x already a bf16 value (round_bf16's result)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t(u >> 16);
}

template <typename T>
inline float rnd(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return round_bf16(x);
  }
}

template <typename T>
inline float to_f(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return bf16_bits_to_float(x.x);
  }
}

// RoPE on q and k of qkv [M, (H + 2 Hkv) hd] (T: its dtype, and cos / sin's), each op rounded as apply_rope's
// ATen ops round in T (x * cos, roll(x) * sin, their sum); q out as fp32 [M, H, hd], k and v into their slots
template <typename T>
void rope_write(const T* qkv, const T* cos, const T* sin, float* q, float* kc, float* vc, const Slots& sl,
                int64_t heads, int64_t kv_heads, int64_t s_n, int64_t s_h, int64_t s_t) {
  const int64_t hd = sl.hd, half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  at::parallel_for(0, sl.m, ROW_GRAIN, [&](int64_t row0, int64_t row1) {
    for (int64_t row = row0; row < row1; ++row) {
      const int64_t r = row / sl.t, at = sl.cache_rows[r] * s_n + (sl.start[r] + row % sl.t) * s_t;
      const T *c = cos + row * hd, *s = sin + row * hd;
      for (int64_t j = 0; j < heads + 2 * kv_heads; ++j) {
        const T* x = qkv + row * width + j * hd;
        float* dst = j < heads ? q + (row * heads + j) * hd
                               : (j < heads + kv_heads ? kc : vc) + at + ((j - heads) % kv_heads) * s_h;
        if (j >= heads + kv_heads) {
          for (int64_t i = 0; i < hd; ++i) dst[i] = to_f(x[i]);
          continue;
        }
        for (int64_t i = 0; i < half; ++i)
          dst[i] = rnd<T>(rnd<T>(to_f(x[i]) * to_f(c[i])) + rnd<T>(to_f(x[i + half]) * to_f(s[i])));
        for (int64_t i = half; i < hd; ++i)
          dst[i] = rnd<T>(rnd<T>(to_f(x[i]) * to_f(c[i])) + rnd<T>(to_f(x[i - half]) * to_f(s[i])));
      }
    }
  });
}

using BF16 = at::BFloat16;

// y = bf16(bf16(x * rstd) * w) for the residual hf [M, D] (fp32 holding bf16 values): RMSNorm in bf16 as the
// Python layer computes it (rms_norm over x's fp32 copy, cast to bf16, times the bf16 weight)
torch::Tensor rms_norm_bf16(const std::vector<float>& hf, int64_t rows, int64_t d, const torch::Tensor& w, double eps,
                            const torch::TensorOptions& opts) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == d, "norm weight must be bf16 [D]");
  auto y = torch::empty({rows, d}, opts.dtype(at::kBFloat16));
  const BF16* wp = w.data_ptr<BF16>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<BF16>());
  std::vector<float> wf(d);
  for (int64_t i = 0; i < d; ++i) wf[i] = to_f(wp[i]);
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = hf.data() + r * d;
      const float inv = 1.f / std::sqrt(dot(x, x, d) / static_cast<float>(d) + static_cast<float>(eps));
      uint16_t* yr = yp + r * d;
      for (int64_t i = 0; i < d; ++i) yr[i] = float_to_bf16_bits(round_bf16(round_bf16(x[i] * inv) * wf[i]));
    }
  });
  return y;
}

// hf += y elementwise, rounded to bf16 (ATen's bf16 add); y bf16 [M, D]
void add_bf16(std::vector<float>& hf, const torch::Tensor& y_in) {
  const auto y = y_in.contiguous();
  const uint16_t* yp = reinterpret_cast<const uint16_t*>(y.data_ptr<BF16>());
  at::parallel_for(0, static_cast<int64_t>(hf.size()), ROW_GRAIN * 512, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) hf[i] = round_bf16(hf[i] + bf16_bits_to_float(yp[i]));
  });
}

// act = bf16(bf16(silu(gate)) * up) for gu bf16 [M, 2I] (F.silu(gate).mul_(up) in bf16)
torch::Tensor silu_mul_bf16(const torch::Tensor& gu_in) {
  const auto gu = gu_in.contiguous();
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  auto act = torch::empty({rows, inter}, gu.options());
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(gu.data_ptr<BF16>());
  uint16_t* ap = reinterpret_cast<uint16_t*>(act.data_ptr<BF16>());
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    std::vector<float> g(inter), e(inter);
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* gr = gp + r * 2 * inter;
      for (int64_t i = 0; i < inter; ++i) g[i] = -bf16_bits_to_float(gr[i]);
      exp_shifted(g.data(), 0.f, e.data(), inter);  // exp(-g)
      for (int64_t i = 0; i < inter; ++i) {
        const float s = round_bf16(-g[i] / (1.f + e[i]));
        ap[r * inter + i] = float_to_bf16_bits(round_bf16(s * bf16_bits_to_float(gr[inter + i])));
      }
    }
  });
  return act;
}

// the bf16 layer (see decode_layer): the Python layer's ops on a bf16 model, their roundings kept; the residual
// held in fp32 between the ops (bf16 values, rounded after each add)
torch::Tensor decode_layer_bf16(torch::Tensor h, const torch::Tensor& in_norm, const torch::Tensor& post_norm,
                                double eps, const std::vector<torch::Tensor>& w, torch::Tensor cos,
                                torch::Tensor sin, const torch::Tensor& kc, const torch::Tensor& vc,
                                const torch::Tensor& starts, const c10::optional<torch::Tensor>& rows, int64_t heads,
                                int64_t kv_heads, double scale, const c10::optional<torch::Tensor>& tree) {
  const Slots sl = check_slots(h, cos, sin, kc, vc, starts, rows, heads, kv_heads, tree);
  h = h.contiguous();
  const int64_t hd = sl.hd, m = sl.m, d = h.size(1);
  std::vector<float> hf(m * d);
  const uint16_t* hp = reinterpret_cast<const uint16_t*>(h.data_ptr<BF16>());
  for (int64_t i = 0; i < m * d; ++i) hf[i] = bf16_bits_to_float(hp[i]);
  auto qkv = dense_linear(rms_norm_bf16(hf, m, d, in_norm, eps, h.options()), w[0]).contiguous();
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * hd, "qkv has ", qkv.size(1), " columns");
  auto q = torch::empty({m, heads, hd}, h.options().dtype(at::kFloat));
  rope_write(qkv.data_ptr<BF16>(), cos.data_ptr<BF16>(), sin.data_ptr<BF16>(), q.data_ptr<float>(),
             kc.data_ptr<float>(), vc.data_ptr<float>(), sl, heads, kv_heads, kc.stride(0), kc.stride(1),
             kc.stride(2));
  auto o = torch::empty({m, heads * hd}, q.options());
  attend(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), sl.tree, o.data_ptr<float>(), sl.start,
         sl.cache_rows.data(), sl.n, sl.t, heads, kv_heads, kc.stride(0), kc.stride(1), kc.stride(2), hd,
         static_cast<float>(scale));
  add_bf16(hf, dense_linear(o.to(at::kBFloat16), w[1]));
  add_bf16(hf, dense_linear(silu_mul_bf16(dense_linear(rms_norm_bf16(hf, m, d, post_norm, eps, h.options()), w[2])),
                            w[3]));
  auto out = torch::empty({m, d}, h.options());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<BF16>());
  for (int64_t i = 0; i < m * d; ++i) op[i] = float_to_bf16_bits(hf[i]);
  return out;
}

// a norm weight of the form's: fp32 [n], contiguous
const float* norm_weight(const c10::optional<torch::Tensor>& w, int64_t n, const char* name) {
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == n, name, " must be fp32 [", n,
              "], got ", w->scalar_type(), " ", w->sizes());
  return w->data_ptr<float>();
}

// each head's q and k in qkv [M, (H + 2 Hkv) hd] normed in place (the form's q_norm, k_norm)
void norm_heads(torch::Tensor& qkv, const LayerForm& form, double eps, int64_t heads, int64_t kv_heads, int64_t hd) {
  const float* qn = norm_weight(form.q_norm, hd, "q_norm");
  const float* kn = norm_weight(form.k_norm, hd, "k_norm");
  float* p = qkv.data_ptr<float>();
  const int64_t width = qkv.size(1);
  at::parallel_for(0, qkv.size(0), ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      rms_norm_rows(p + r * width, qn, static_cast<float>(eps), p + r * width, heads, hd);
      rms_norm_rows(p + (r * width + heads * hd), kn, static_cast<float>(eps), p + (r * width + heads * hd), kv_heads,
                    hd);
    }
  });
}

// residual + y, or residual + rms_norm(y) * w with an output norm (y normed in place): a residual add
torch::Tensor add_residual(torch::Tensor y, const torch::Tensor& residual, const c10::optional<torch::Tensor>& w,
                           double eps, const char* name) {
  if (w.has_value())
    rms_norm_rows(y.data_ptr<float>(), norm_weight(w, y.size(1), name), static_cast<float>(eps), y.data_ptr<float>(),
                  y.size(0), y.size(1));
  return y.add_(residual);
}

}  // namespace

// A whole decoder layer for T new tokens per row (a decode step: T = 1; a drafted chain or tree being
// verified: T nodes): norm + qkv, RoPE on q and k (rotate-half with the sign folded into sin: x*cos +
// roll(x)*sin), row r's tokens' K/V written into slots [starts[r], starts[r] + T) of cache row rows[r] (rows
// absent: r) of kc / vc [B, Hkv, S, hd], attention (see attend; tree [N, T, T] bool, node j sees node i
// where tree[r, j, i], none: causal), o + residual, the MLP; with what form adds (q/k norms before RoPE, output
// norms before the residual adds, GeGLU, a window). h [N T, D] row-major over (row, token); cos, sin
// [N, 1, T, hd] (the layer's RoPE table); starts, rows int64 [N] on the CPU. The Python layer's math. Weights:
// low-bit planes, GGUF blocks, or one dense matrix each (fp32; bf16 packed by oneDNN, where h is bf16 and the
// layer is Llama's: decode_layer_bf16); K/V are fp32.
torch::Tensor decode_layer(torch::Tensor h, torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                           std::vector<torch::Tensor> qkv_w, std::vector<torch::Tensor> o_w,
                           std::vector<torch::Tensor> gu_w, std::vector<torch::Tensor> dn_w, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor kc, torch::Tensor vc, torch::Tensor starts,
                           c10::optional<torch::Tensor> rows, int64_t heads, int64_t kv_heads, double scale,
                           c10::optional<torch::Tensor> tree, const LayerForm& form) {
  const bool blocks = std::any_of(form.fmts.begin(), form.fmts.end(), [](const std::string& f) { return !f.empty(); });
  const bool llama = !form.q_norm && !form.k_norm && !form.attn_out_norm && !form.mlp_out_norm &&
                     form.act == "silu" && form.window == 0 && !blocks;
  TORCH_CHECK(form.act == "silu" || form.act == "gelu_pytorch_tanh", "activation '", form.act,
              "': expected silu or gelu_pytorch_tanh");
  TORCH_CHECK(form.fmts.empty() || form.fmts.size() == 4, "fmts: one per linear (qkv, o, gate_up, down) or none");
  TORCH_CHECK(form.q_norm.has_value() == form.k_norm.has_value(), "q_norm and k_norm go together");
  if (h.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(llama, "a bf16 layer is a Llama layer (no q/k or output norms, SiLU, no window, dense matrices)");
    TORCH_CHECK(qkv_w.size() == 1 && o_w.size() == 1 && gu_w.size() == 1 && dn_w.size() == 1,
                "a bf16 layer takes one dense matrix per linear");
    return decode_layer_bf16(h, in_norm, post_norm, eps, {qkv_w[0], o_w[0], gu_w[0], dn_w[0]}, cos, sin, kc, vc,
                             starts, rows, heads, kv_heads, scale, tree);
  }
  const Slots sl = check_slots(h, cos, sin, kc, vc, starts, rows, heads, kv_heads, tree);
  const int64_t hd = sl.hd, m = sl.m;
  auto fmt = [&](size_t i) { return form.fmts.empty() ? std::string() : form.fmts[i]; };
  auto qkv = weight_of(qkv_w, fmt(0))(rms_norm(h, in_norm, eps)).contiguous();  // [N T, (H + 2 Hkv) hd]
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * hd, "qkv has ", qkv.size(1), " columns");
  if (form.q_norm) norm_heads(qkv, form, eps, heads, kv_heads, hd);
  auto q = torch::empty({m, heads, hd}, h.options());
  rope_write(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(),
             kc.data_ptr<float>(), vc.data_ptr<float>(), sl, heads, kv_heads, kc.stride(0), kc.stride(1),
             kc.stride(2));
  auto o = torch::empty({m, heads * hd}, h.options());
  attend(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), sl.tree, o.data_ptr<float>(), sl.start,
         sl.cache_rows.data(), sl.n, sl.t, heads, kv_heads, kc.stride(0), kc.stride(1), kc.stride(2), hd,
         static_cast<float>(scale), form.window);
  h = add_residual(weight_of(o_w, fmt(1))(o), h, form.attn_out_norm, eps, "attn_out_norm");
  auto gu = weight_of(gu_w, fmt(2))(rms_norm(h, post_norm, eps));  // [N T, 2I]
  const int64_t inter = gu.size(1) / 2;
  auto act = torch::empty({m, inter}, gu.options());
  (form.act == "silu" ? silu_mul : gelu_tanh_mul)(gu.data_ptr<float>(), act.data_ptr<float>(), m, inter);
  return add_residual(weight_of(dn_w, fmt(3))(act), h, form.mlp_out_norm, eps, "mlp_out_norm");
}

torch::Tensor LayerStack::forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor k,
                                  torch::Tensor v, torch::Tensor starts, c10::optional<torch::Tensor> rows,
                                  c10::optional<torch::Tensor> tree) const {
  const int64_t layers = static_cast<int64_t>(in_norms.size());
  TORCH_CHECK(k.dim() == 5 && k.size(0) == layers && v.sizes() == k.sizes(),
              "K/V must be [", layers, ", B, Hkv, S, hd]");
  cos = cos.contiguous();
  sin = sin.contiguous();
  for (int64_t i = 0; i < layers; ++i)
    h = decode_layer(h, in_norms[i], post_norms[i], eps, qkv[i], o[i], gate_up[i], down[i], cos, sin, k.select(0, i),
                     v.select(0, i), starts, rows, heads, kv_heads, scale, tree, LayerForm{});
  return h;
}
