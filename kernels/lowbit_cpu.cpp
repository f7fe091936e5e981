// Low-bit GEMV/GEMM for decode on CPU: y[B, O] = x[B, I] @ dequant(W)[O, I]^T with the weight read once
// per call and dequantized in registers, never materialized. Activations and accumulation are fp32.
//
// Formats (llama.cpp's blocks of 32 along the input dimension, split into planes):
//   q4 (Q4_1): qs uint8 [O, I/2]: block g of row o is qs[o, 16g : 16g+16]; element j < 16 is the low
//              nibble of byte j, element j + 16 its high nibble. d, m fp16 [O, I/32]: w = d * q + m.
//   q8 (Q8_0): qs int8 [O, I]; d fp16 [O, I/32]: w = d * q.
// Per block the dot product is split as d * (q . x) + m * sum(x), so the min costs one scalar FMA.
// Built with -march=native at first use (kernels/cpu_ext.py): AVX2+FMA+F16C intrinsics where the
// machine has them, a plain loop elsewhere. Both give the same sums up to fp32 reassociation.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LOWBIT_AVX2 1
#else
#define LOWBIT_AVX2 0
#endif

namespace {

constexpr int64_t QK = 32;  // weights per block

inline float h2f(const at::Half h) {
#if LOWBIT_AVX2
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

void check(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, int64_t bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous fp32 [B, I]");
  const int64_t in = x.size(1);
  TORCH_CHECK(in % QK == 0, "in_features ", in, " is not a multiple of ", QK);
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == in / QK * bytes_per_block,
              "qs must be contiguous [O, ", in / QK * bytes_per_block, "], got ", qs.sizes());
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kHalf && d.is_contiguous() && d.size(0) == qs.size(0) &&
                  d.size(1) == in / QK,
              "scales must be contiguous fp16 [O, I/32]");
}

// sums of x per block: xs [B, G]; used for the q4 minimum term
std::vector<float> block_sums(const float* x, int64_t b, int64_t in) {
  const int64_t g = in / QK;
  std::vector<float> xs(b * g);
  for (int64_t r = 0; r < b; ++r)
    for (int64_t k = 0; k < g; ++k) {
      float s = 0.f;
      for (int64_t j = 0; j < QK; ++j) s += x[r * in + k * QK + j];
      xs[r * g + k] = s;
    }
  return xs;
}

#if LOWBIT_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// one block's q . x for every row r, added (times d) into acc[r]; q = four vectors of 8 floats
inline void block_fma(const __m256 q[4], const float* x, int64_t in, int64_t b, float dd, __m256* acc) {
  const __m256 vd = _mm256_set1_ps(dd);
  for (int64_t r = 0; r < b; ++r) {
    const float* xr = x + r * in;
    __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
    t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), t);
    t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16), t);
    t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), t);
    acc[r] = _mm256_fmadd_ps(t, vd, acc[r]);
  }
}
#endif

}  // namespace

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  check(x, qs, d, QK / 2);
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == at::kHalf && m.is_contiguous(), "m must match d");
  const int64_t b = x.size(0), in = x.size(1), out = qs.size(0), g = in / QK;
  auto y = torch::empty({b, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const std::vector<float> xs = block_sums(xp, b, in);
  at::parallel_for(0, out, 16, [&](int64_t o0, int64_t o1) {
#if LOWBIT_AVX2
    std::vector<__m256> acc(b);
    const __m128i low = _mm_set1_epi8(0x0F);
#endif
    std::vector<float> accm(b);
    for (int64_t o = o0; o < o1; ++o) {
#if LOWBIT_AVX2
      for (int64_t r = 0; r < b; ++r) acc[r] = _mm256_setzero_ps();
#endif
      for (int64_t r = 0; r < b; ++r) accm[r] = 0.f;
      for (int64_t k = 0; k < g; ++k) {
        const uint8_t* blk = qp + (o * g + k) * (QK / 2);
        const float dd = h2f(dp[o * g + k]), mm = h2f(mp[o * g + k]);
        for (int64_t r = 0; r < b; ++r) accm[r] += mm * xs[r * g + k];
#if LOWBIT_AVX2
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
        const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        const __m256 q[4] = {u8x8_to_ps(lo), u8x8_to_ps(_mm_srli_si128(lo, 8)), u8x8_to_ps(hi),
                             u8x8_to_ps(_mm_srli_si128(hi, 8))};
        block_fma(q, xp + k * QK, in, b, dd, acc.data());
#else
        for (int64_t r = 0; r < b; ++r) {
          const float* xr = xp + r * in + k * QK;
          float s = 0.f;
          for (int64_t j = 0; j < QK / 2; ++j) s += (blk[j] & 0x0F) * xr[j] + (blk[j] >> 4) * xr[j + QK / 2];
          accm[r] += dd * s;
        }
#endif
      }
      for (int64_t r = 0; r < b; ++r) {
#if LOWBIT_AVX2
        yp[r * out + o] = hsum(acc[r]) + accm[r];
#else
        yp[r * out + o] = accm[r];
#endif
      }
    }
  });
  return y;
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  TORCH_CHECK(qs.scalar_type() == at::kChar, "q8 qs must be int8");
  check(x, qs, d, QK);
  const int64_t b = x.size(0), in = x.size(1), out = qs.size(0), g = in / QK;
  auto y = torch::empty({b, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qs.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, 16, [&](int64_t o0, int64_t o1) {
#if LOWBIT_AVX2
    std::vector<__m256> acc(b);
#else
    std::vector<float> acc(b);
#endif
    for (int64_t o = o0; o < o1; ++o) {
#if LOWBIT_AVX2
      for (int64_t r = 0; r < b; ++r) acc[r] = _mm256_setzero_ps();
#else
      for (int64_t r = 0; r < b; ++r) acc[r] = 0.f;
#endif
      for (int64_t k = 0; k < g; ++k) {
        const int8_t* blk = qp + (o * g + k) * QK;
        const float dd = h2f(dp[o * g + k]);
#if LOWBIT_AVX2
        const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
        const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16));
        const __m256 q[4] = {i8x8_to_ps(r0), i8x8_to_ps(_mm_srli_si128(r0, 8)), i8x8_to_ps(r1),
                             i8x8_to_ps(_mm_srli_si128(r1, 8))};
        block_fma(q, xp + k * QK, in, b, dd, acc.data());
#else
        for (int64_t r = 0; r < b; ++r) {
          const float* xr = xp + r * in + k * QK;
          float s = 0.f;
          for (int64_t j = 0; j < QK; ++j) s += blk[j] * xr[j];
          acc[r] += dd * s;
        }
#endif
      }
      for (int64_t r = 0; r < b; ++r) {
#if LOWBIT_AVX2
        yp[r * out + o] = hsum(acc[r]);
#else
        yp[r * out + o] = acc[r];
#endif
      }
    }
  });
  return y;
}

// dequantize rows into fp32 [O, I] (prefill: many rows make a dense GEMM cheaper than the kernels above)
torch::Tensor dequantize(torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m) {
  const bool q4 = m.has_value();
  const int64_t out = qs.size(0), g = d.size(1), in = g * QK;
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && d.scalar_type() == at::kHalf, "bad q planes");
  TORCH_CHECK(qs.size(1) == (q4 ? in / 2 : in), "qs has ", qs.size(1), " bytes per row, expected ", q4 ? in / 2 : in);
  auto w = torch::empty({out, in}, d.options().dtype(at::kFloat));
  float* wp = w.data_ptr<float>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = q4 ? m->data_ptr<at::Half>() : nullptr;
  const uint8_t* q4p = q4 ? qs.data_ptr<uint8_t>() : nullptr;
  const int8_t* q8p = q4 ? nullptr : qs.data_ptr<int8_t>();
  at::parallel_for(0, out * g, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const float dd = h2f(dp[blk]);
      float* o = wp + blk * QK;
      if (q4) {
        const float mm = h2f(mp[blk]);
        const uint8_t* p = q4p + blk * (QK / 2);
        for (int64_t j = 0; j < QK / 2; ++j) {
          o[j] = dd * (p[j] & 0x0F) + mm;
          o[j + QK / 2] = dd * (p[j] >> 4) + mm;
        }
      } else {
        const int8_t* p = q8p + blk * QK;
        for (int64_t j = 0; j < QK; ++j) o[j] = dd * p[j];
      }
    }
  });
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_linear", &q4_linear, "x [B, I] fp32 @ dequant(Q4_1 planes)^T -> [B, O] fp32");
  mod.def("q8_linear", &q8_linear, "x [B, I] fp32 @ dequant(Q8_0 planes)^T -> [B, O] fp32");
  mod.def("dequantize", &dequantize, "Q4_1 (with m) or Q8_0 planes -> fp32 [O, I]");
  mod.def("simd", []() { return LOWBIT_AVX2 ? std::string("avx2+fma+f16c") : std::string("scalar"); });
}
