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

// y[i] = exp(x[i] - shift), returns the sum of y
inline float exp_shifted(const float* x, float shift, float* y, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if LOWBIT_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(shift)));
    _mm512_storeu_ps(y + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  s = _mm512_reduce_add_ps(acc);
#elif LOWBIT_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(shift)));
    _mm256_storeu_ps(y + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  s = hsum(acc);
#endif
  for (; i < n; ++i) s += (y[i] = exp_scalar(x[i] - shift));
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

// Attention for T new tokens per row r written at slots [start[r], start[r] + T) of its cache row cr[r]: query
// (row r, token j, head h) sees slots [0, start[r]) and the chunk's slots start[r] + i that tree[r, j, i] marks
// (nullptr: i <= j, a causal chunk). o = softmax(scale * q K^T) V over what it sees. GQA: heads / kv_heads
// query heads share a K/V head. q, o [N T, H, hd]; K, V strided [B, Hkv, S, hd] (s_* the strides of B, Hkv, S).
void attend(const float* q, const float* kc, const float* vc, const bool* tree, float* o, const int64_t* start,
            const int64_t* cr, int64_t n, int64_t t, int64_t heads, int64_t kv_heads, int64_t s_n, int64_t s_h,
            int64_t s_t, int64_t hd, float scale) {
  const int64_t group = heads / kv_heads, longest = *std::max_element(start, start + n) + t;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, longest * hd));  // ~32k multiply-adds a task
  at::parallel_for(0, n * t * heads, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> p(longest);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t row = b / heads, r = row / t, j = row % t, kvh = (b % heads) / group, s0 = start[r];
      const float* qb = q + b * hd;
      const float* K = kc + cr[r] * s_n + kvh * s_h;
      const float* V = vc + cr[r] * s_n + kvh * s_h;
      auto sees = [&](int64_t i) { return tree != nullptr ? tree[row * t + i] : i <= j; };
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t x = 0; x < s0; ++x) mx = std::max(mx, p[x] = dot(qb, K + x * s_t, hd) * scale);
      for (int64_t i = 0; i < t; ++i)
        if (sees(i)) mx = std::max(mx, p[s0 + i] = dot(qb, K + (s0 + i) * s_t, hd) * scale);
      float sum = exp_shifted(p.data(), mx, p.data(), s0);
      for (int64_t i = 0; i < t; ++i) sum += (p[s0 + i] = sees(i) ? exp_scalar(p[s0 + i] - mx) : 0.f);
      const float inv = 1.f / sum;
      float* ob = o + b * hd;
      std::fill(ob, ob + hd, 0.f);
      for (int64_t x = 0; x < s0 + t; ++x)
        if (p[x] != 0.f) axpy(ob, p[x] * inv, V + x * s_t, hd);
    }
  });
}

using Planes = std::tuple<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>>;

Planes planes_of(const std::vector<torch::Tensor>& w) {
  TORCH_CHECK(w.size() == 2 || w.size() == 3, "weight planes are (qs, d) or (qs, d, m)");
  return {w[0], w[1], w.size() == 3 ? c10::optional<torch::Tensor>(w[2]) : c10::nullopt};
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

// A whole decoder layer for T new tokens per row (a decode step: T = 1; a drafted chain or tree being
// verified: T nodes): norm + qkv, RoPE on q and k (rotate-half with the sign folded into sin: x*cos +
// roll(x)*sin), row r's tokens' K/V written into slots [starts[r], starts[r] + T) of cache row rows[r] (rows
// absent: r) of kc / vc [B, Hkv, S, hd], attention (see attend; tree [N, T, T] bool, node j sees node i
// where tree[r, j, i], none: causal), o + residual, the MLP. h [N T, D] fp32, row-major over (row, token);
// cos, sin [N, 1, T, hd]; starts, rows int64 [N] on the CPU. The Python layer's math.
torch::Tensor decode_layer(torch::Tensor h, torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                           std::vector<torch::Tensor> qkv_w, std::vector<torch::Tensor> o_w,
                           std::vector<torch::Tensor> gu_w, std::vector<torch::Tensor> dn_w, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor kc, torch::Tensor vc, torch::Tensor starts,
                           c10::optional<torch::Tensor> rows, int64_t heads, int64_t kv_heads, double scale,
                           c10::optional<torch::Tensor> tree) {
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == at::kLong && starts.is_contiguous() && starts.is_cpu(),
              "starts must be a contiguous int64 [N] on the CPU");
  const int64_t n = starts.size(0), m = h.size(0), t = m / std::max<int64_t>(n, 1), hd = kc.size(3), half = hd / 2;
  TORCH_CHECK(kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.stride(3) == 1 &&
                  vc.stride(3) == 1 && kc.strides() == vc.strides() && kc.sizes() == vc.sizes() &&
                  kc.size(1) == kv_heads,
              "the K/V slots must be fp32 [B, Hkv, S, hd] with unit stride over hd");
  TORCH_CHECK(n >= 1 && t >= 1 && m == n * t, "h has ", m, " rows: not T tokens for each of ", n, " rows");
  std::vector<int64_t> cache_rows(n);
  for (int64_t r = 0; r < n; ++r) cache_rows[r] = r;
  if (rows.has_value()) {
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == n && rows->scalar_type() == at::kLong && rows->is_cpu(),
                "rows must be int64 [N] on the CPU");
    std::copy(rows->data_ptr<int64_t>(), rows->data_ptr<int64_t>() + n, cache_rows.begin());
  }
  const int64_t* ps0 = starts.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(cache_rows[r] >= 0 && cache_rows[r] < kc.size(0), "cache row ", cache_rows[r], " is out of range");
    TORCH_CHECK(ps0[r] >= 0 && ps0[r] + t <= kc.size(2), "slots ", ps0[r], "..", ps0[r] + t, " are past the cache's ",
                kc.size(2));
  }
  cos = cos.contiguous();  // a batch of one may come as a broadcast view
  sin = sin.contiguous();
  TORCH_CHECK(cos.numel() == m * hd && sin.numel() == m * hd && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "cos, sin must be fp32 [N, 1, T, hd]");
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  const bool* ptree = nullptr;
  if (tree.has_value()) {
    TORCH_CHECK(tree->scalar_type() == at::kBool && tree->is_contiguous() && tree->numel() == n * t * t,
                "tree must be a contiguous bool [N, T, T]");
    ptree = tree->data_ptr<bool>();
  }
  auto [qq, qd, qm] = planes_of(qkv_w);
  auto qkv = norm_linear(h, in_norm, eps, qq, qd, qm);  // [N T, (H + 2 Hkv) hd]
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * hd, "qkv has ", qkv.size(1), " columns");
  auto q = torch::empty({m, heads, hd}, h.options());
  const float* pqkv = qkv.data_ptr<float>();
  const float *pc = cos.data_ptr<float>(), *ps = sin.data_ptr<float>();
  float *pq = q.data_ptr<float>(), *pk = kc.data_ptr<float>(), *pv = vc.data_ptr<float>();
  const int64_t s_n = kc.stride(0), s_h = kc.stride(1), s_t = kc.stride(2), width = qkv.size(1);
  for (int64_t row = 0; row < m; ++row) {
    const int64_t r = row / t, at = cache_rows[r] * s_n + (ps0[r] + row % t) * s_t;
    const float *c = pc + row * hd, *s = ps + row * hd;
    for (int64_t j = 0; j < heads + 2 * kv_heads; ++j) {
      const float* x = pqkv + row * width + j * hd;
      float* dst = j < heads ? pq + (row * heads + j) * hd
                             : (j < heads + kv_heads ? pk : pv) + at + ((j - heads) % kv_heads) * s_h;
      if (j >= heads + kv_heads) {
        std::copy(x, x + hd, dst);
        continue;
      }
      for (int64_t i = 0; i < hd; ++i) dst[i] = x[i] * c[i] + x[i < half ? i + half : i - half] * s[i];
    }
  }
  auto o = torch::empty({m, heads * hd}, h.options());
  attend(pq, pk, pv, ptree, o.data_ptr<float>(), ps0, cache_rows.data(), n, t, heads, kv_heads, s_n, s_h, s_t, hd,
         static_cast<float>(scale));
  auto [oq, od, om] = planes_of(o_w);
  h = linear_add(o, oq, od, om, h);
  auto [gq, gd, gm] = planes_of(gu_w);
  auto [dq, dd, dm] = planes_of(dn_w);
  return mlp(h, post_norm, eps, gq, gd, gm, dq, dd, dm);
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
                     v.select(0, i), starts, rows, heads, kv_heads, scale, tree);
  return h;
}
