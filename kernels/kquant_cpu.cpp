// llama.cpp's block formats read in their own bytes (q4_0, q5_0, q5_1 in blocks of 32; q4_k, q5_k, q6_k in
// super-blocks of 256): y[B, O] = x[B, I] @ dequant(W)[O, I]^T with fp32 activations, and the byte-exact
// dequantization. W is uint8 [O, I / n * bytes], each row its blocks as a GGUF file stores them (the layouts:
// kernels/ggml_blocks.py, the plain-torch reference). Part of lowbit_cpu.cpp's translation unit.
//
// Each block's 32-weight sub-blocks are formed in registers (L lanes: 16 with AVX-512, 8 with AVX2, 1 in the
// plain loop; the same code for all three through the few vector ops below) with the roundings gguf's
// reference makes (q4_k: (d * sc) * q - (dmin * mn), a product then a difference; no FMA: the build has
// -ffp-contract=off), so blocks_dequantize equals gguf.quants.dequantize bit for bit and blocks_linear is the
// dot product of those exact weights with x. A block's weights are formed once per output row and shared by a
// tile of up to 8 activation rows.
#include "lowbit_cpu.h"

namespace kq {

#if LOWBIT_AVX512
using VF = __m512;
using VI = __m512i;
constexpr int L = 16;
inline VI ld_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI srl(VI a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline VI shl4(VI a) { return _mm512_slli_epi32(a, 4); }
inline VI band(VI a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
inline VI bor(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI isub(VI a, int n) { return _mm512_sub_epi32(a, _mm512_set1_epi32(n)); }
// bits e0 .. e0 + L - 1 of w, one a lane
inline VI bits(uint32_t w, int e0) {
  const VI idx = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                  _mm512_set1_epi32(e0));
  return band(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(w)), idx), 1);
}
inline VF cvt(VI a) { return _mm512_cvtepi32_ps(a); }
inline VF mul(VF a, float s) { return _mm512_mul_ps(a, _mm512_set1_ps(s)); }
inline VF subs(VF a, float s) { return _mm512_sub_ps(a, _mm512_set1_ps(s)); }
inline VF adds(VF a, float s) { return _mm512_add_ps(a, _mm512_set1_ps(s)); }
inline VF zero() { return _mm512_setzero_ps(); }
inline VF fma(VF a, const float* x, VF acc) { return _mm512_fmadd_ps(a, _mm512_loadu_ps(x), acc); }
inline VF add(VF a, VF b) { return _mm512_add_ps(a, b); }
inline void store(float* p, VF a) { _mm512_storeu_ps(p, a); }
inline float hsum_v(VF a) { return hsum16(a); }
#elif LOWBIT_AVX2
using VF = __m256;
using VI = __m256i;
constexpr int L = 8;
inline VI ld_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VI srl(VI a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline VI shl4(VI a) { return _mm256_slli_epi32(a, 4); }
inline VI band(VI a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
inline VI bor(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI isub(VI a, int n) { return _mm256_sub_epi32(a, _mm256_set1_epi32(n)); }
inline VI bits(uint32_t w, int e0) {
  const VI idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(e0));
  return band(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), idx), 1);
}
inline VF cvt(VI a) { return _mm256_cvtepi32_ps(a); }
inline VF mul(VF a, float s) { return _mm256_mul_ps(a, _mm256_set1_ps(s)); }
inline VF subs(VF a, float s) { return _mm256_sub_ps(a, _mm256_set1_ps(s)); }
inline VF adds(VF a, float s) { return _mm256_add_ps(a, _mm256_set1_ps(s)); }
inline VF zero() { return _mm256_setzero_ps(); }
inline VF fma(VF a, const float* x, VF acc) { return _mm256_fmadd_ps(a, _mm256_loadu_ps(x), acc); }
inline VF add(VF a, VF b) { return _mm256_add_ps(a, b); }
inline void store(float* p, VF a) { _mm256_storeu_ps(p, a); }
inline float hsum_v(VF a) { return hsum(a); }
#else
using VF = float;
using VI = int32_t;
constexpr int L = 1;
inline VI ld_u8(const uint8_t* p) { return *p; }
inline VI srl(VI a, int n) { return static_cast<int32_t>(static_cast<uint32_t>(a) >> n); }
inline VI shl4(VI a) { return a << 4; }
inline VI band(VI a, int m) { return a & m; }
inline VI bor(VI a, VI b) { return a | b; }
inline VI isub(VI a, int n) { return a - n; }
inline VI bits(uint32_t w, int e0) { return (w >> e0) & 1; }
inline VF cvt(VI a) { return static_cast<float>(a); }
inline VF mul(VF a, float s) { return a * s; }
inline VF subs(VF a, float s) { return a - s; }
inline VF adds(VF a, float s) { return a + s; }
inline VF zero() { return 0.f; }
inline VF fma(VF a, const float* x, VF acc) { return acc + a * *x; }
inline VF add(VF a, VF b) { return a + b; }
inline void store(float* p, VF a) { *p = a; }
inline float hsum_v(VF a) { return a; }
#endif
constexpr int C = 32 / L;  // vectors per 32 weights

inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return h2f(h);
}
inline uint32_t u32_at(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// A format: N weights and BYTES bytes per block; prep() reads a block's scales once, sub() forms its 32-weight
// sub-block s (N / 32 of them) as C vectors.
struct Q4_0 {
  static constexpr int N = 32, BYTES = 18;
  struct P { float d; };
  static void prep(const uint8_t* b, P& p) { p.d = half_at(b); }
  static void sub(const uint8_t* b, const P& p, int, VF* w) {
    for (int c = 0; c < C; ++c) {
      const int e = c * L;
      w[c] = mul(cvt(isub(band(srl(ld_u8(b + 2 + e % 16), 4 * (e / 16)), 15), 8)), p.d);
    }
  }
};

struct Q5_0 {
  static constexpr int N = 32, BYTES = 22;
  struct P { float d; uint32_t qh; };
  static void prep(const uint8_t* b, P& p) { p.d = half_at(b); p.qh = u32_at(b + 2); }
  static void sub(const uint8_t* b, const P& p, int, VF* w) {
#if LOWBIT_AVX512
    // the block's 32 possible weights (q - 16) * d in two tables, an element's fifth bit (a mask register straight
    // from qh) choosing the table: vpermt2ps reads an index's low 5 bits
    const VF lo = mul(_mm512_setr_ps(-16.f, -15.f, -14.f, -13.f, -12.f, -11.f, -10.f, -9.f, -8.f, -7.f, -6.f, -5.f,
                                     -4.f, -3.f, -2.f, -1.f), p.d);
    const VF hi = mul(_mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f,
                                     15.f), p.d);
    const VI raw = ld_u8(b + 6);
    const VI nib[2] = {band(raw, 15), srl(raw, 4)};  // elements 0..15, 16..31
    for (int c = 0; c < 2; ++c) {
      const __mmask16 fifth = static_cast<__mmask16>(p.qh >> (16 * c));
      w[c] = _mm512_permutex2var_ps(lo, _mm512_mask_or_epi32(nib[c], fifth, nib[c], _mm512_set1_epi32(16)), hi);
    }
#else
    for (int c = 0; c < C; ++c) {
      const int e = c * L;
      const VI q = bor(band(srl(ld_u8(b + 6 + e % 16), 4 * (e / 16)), 15), shl4(bits(p.qh, e)));
      w[c] = mul(cvt(isub(q, 16)), p.d);
    }
#endif
  }
};

struct Q5_1 {
  static constexpr int N = 32, BYTES = 24;
  struct P { float d, m; uint32_t qh; };
  static void prep(const uint8_t* b, P& p) { p.d = half_at(b); p.m = half_at(b + 2); p.qh = u32_at(b + 4); }
  static void sub(const uint8_t* b, const P& p, int, VF* w) {
    for (int c = 0; c < C; ++c) {
      const int e = c * L;
      const VI q = bor(band(srl(ld_u8(b + 8 + e % 16), 4 * (e / 16)), 15), shl4(bits(p.qh, e)));
      w[c] = adds(mul(cvt(q), p.d), p.m);
    }
  }
};

// q4_k / q5_k: the 12 bytes of 6-bit scales and minimums (ggml's get_scale_min_k4) as dl = d * sc, ml = dmin * mn
inline void k4_scales(const uint8_t* b, float* dl, float* ml) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    if (j < 4) {
      sc = s[j] & 63;
      mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    dl[j] = d * static_cast<float>(sc);
    ml[j] = dmin * static_cast<float>(mn);
  }
}

struct Q4_K {
  static constexpr int N = 256, BYTES = 144;
  struct P { float dl[8], ml[8]; };
  static void prep(const uint8_t* b, P& p) { k4_scales(b, p.dl, p.ml); }
  static void sub(const uint8_t* b, const P& p, int s, VF* w) {
    const uint8_t* q = b + 16 + 32 * (s / 2);
#if LOWBIT_AVX512
    // the sub-block's 16 possible weights dl * i - ml (the same two roundings as each weight's) permuted into
    // place: vpermps reads an index's low 4 bits alone, so a nibble needs no mask and no conversion
    const VF table = subs(mul(_mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                                             14.f, 15.f), p.dl[s]), p.ml[s]);
    for (int c = 0; c < C; ++c) w[c] = _mm512_permutexvar_ps(srl(ld_u8(q + c * L), 4 * (s & 1)), table);
#else
    for (int c = 0; c < C; ++c)
      w[c] = subs(mul(cvt(band(srl(ld_u8(q + c * L), 4 * (s & 1)), 15)), p.dl[s]), p.ml[s]);
#endif
  }
};

struct Q5_K {
  static constexpr int N = 256, BYTES = 176;
  struct P { float dl[8], ml[8]; };
  static void prep(const uint8_t* b, P& p) { k4_scales(b, p.dl, p.ml); }
  static void sub(const uint8_t* b, const P& p, int s, VF* w) {
    const uint8_t* q = b + 48 + 32 * (s / 2);
    const uint8_t* h = b + 16;
    for (int c = 0; c < C; ++c) {
      const VI v = bor(band(srl(ld_u8(q + c * L), 4 * (s & 1)), 15), shl4(band(srl(ld_u8(h + c * L), s), 1)));
      w[c] = subs(mul(cvt(v), p.dl[s]), p.ml[s]);
    }
  }
};

struct Q6_K {
  static constexpr int N = 256, BYTES = 210;
  struct P { float dl[16]; };
  static void prep(const uint8_t* b, P& p) {
    const float d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int j = 0; j < 16; ++j) p.dl[j] = d * static_cast<float>(sc[j]);
  }
  static void sub(const uint8_t* b, const P& p, int s, VF* w) {
    const int h = s / 4, j = s % 4;
    const uint8_t* ql = b + 64 * h + 32 * (j & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    for (int c = 0; c < C; ++c) {
      const int e = c * L;
      const VI v = bor(band(srl(ld_u8(ql + e), 4 * (j >> 1)), 15), shl4(band(srl(ld_u8(qh + e), 2 * j), 3)));
      w[c] = mul(cvt(isub(v, 32)), p.dl[2 * s + e / 16]);
    }
  }
};

// Output rows [o0, o1) for NB activation rows x[0..NB) (stride in): a sub-block's weights formed once and shared
// by the NB rows. P accumulators a row (2 for few rows: independent sums to hide the FMA latency).
template <class F, int NB>
void rows(const float* x, int64_t in, const uint8_t* wp, float* y, int64_t out, int64_t o0, int64_t o1) {
  constexpr int P = NB >= 4 ? 1 : 2;
  const int64_t nblk = in / F::N, rb = nblk * F::BYTES;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = wp + o * rb;
#if LOWBIT_AVX2
    prefetch_ahead(row, rb);
#endif
    VF acc[NB][P];
    for (int r = 0; r < NB; ++r)
      for (int p = 0; p < P; ++p) acc[r][p] = zero();
    for (int64_t k = 0; k < nblk; ++k) {
      const uint8_t* b = row + k * F::BYTES;
      typename F::P pr;
      F::prep(b, pr);
      for (int s = 0; s < F::N / 32; ++s) {
        VF w[C];
        F::sub(b, pr, s, w);
        const int64_t at = k * F::N + 32 * s;
        for (int r = 0; r < NB; ++r)
          for (int c = 0; c < C; ++c) acc[r][c % P] = fma(w[c], x + r * in + at + c * L, acc[r][c % P]);
      }
    }
    for (int r = 0; r < NB; ++r) y[r * out + o] = hsum_v(P == 1 ? acc[r][0] : add(acc[r][0], acc[r][P - 1]));
  }
}

template <class F>
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t b = x.size(0), in = x.size(1), out = w.size(0);
  TORCH_CHECK(in % F::N == 0, "in_features ", in, " is not a multiple of the block's ", F::N);
  TORCH_CHECK(w.size(1) == in / F::N * F::BYTES, "the weight has ", w.size(1), " bytes a row, expected ",
              in / F::N * F::BYTES, " for ", in, " inputs");
  auto y = torch::empty({b, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, 16, [&](int64_t o0, int64_t o1) {
    int64_t r = 0;
    for (; r + 8 <= b; r += 8) rows<F, 8>(xp + r * in, in, wp, yp + r * out, out, o0, o1);
    for (; r + 4 <= b; r += 4) rows<F, 4>(xp + r * in, in, wp, yp + r * out, out, o0, o1);
    const float* xr = xp + r * in;
    float* yr = yp + r * out;
    switch (b - r) {
      case 3: rows<F, 3>(xr, in, wp, yr, out, o0, o1); break;
      case 2: rows<F, 2>(xr, in, wp, yr, out, o0, o1); break;
      case 1: rows<F, 1>(xr, in, wp, yr, out, o0, o1); break;
      default: break;
    }
  });
  return y;
}

template <class F>
torch::Tensor dequant(const torch::Tensor& w, int64_t in) {
  TORCH_CHECK(in % F::N == 0, "in_features ", in, " is not a multiple of the block's ", F::N);
  TORCH_CHECK(w.size(1) == in / F::N * F::BYTES, "the weight has ", w.size(1), " bytes a row, expected ",
              in / F::N * F::BYTES, " for ", in, " inputs");
  const int64_t out = w.size(0), nblk = in / F::N;
  auto y = torch::empty({out, in}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out * nblk, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) {
      const uint8_t* b = wp + k * F::BYTES;
      typename F::P pr;
      F::prep(b, pr);
      for (int s = 0; s < F::N / 32; ++s) {
        VF v[C];
        F::sub(b, pr, s, v);
        for (int c = 0; c < C; ++c) store(yp + k * F::N + 32 * s + c * L, v[c]);
      }
    }
  });
  return y;
}

// the format named fmt ("q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k") as a type, for fn
template <class Fn>
auto dispatch(const std::string& fmt, Fn fn) {
  if (fmt == "q4_k") return fn(Q4_K{});
  if (fmt == "q6_k") return fn(Q6_K{});
  if (fmt == "q5_0") return fn(Q5_0{});
  if (fmt == "q5_k") return fn(Q5_K{});
  if (fmt == "q4_0") return fn(Q4_0{});
  if (fmt == "q5_1") return fn(Q5_1{});
  throw std::invalid_argument("block format '" + fmt + "': expected one of q4_0, q5_0, q5_1, q4_k, q5_k, q6_k");
}

}  // namespace kq

// x fp32 [B, I] @ dequant(w)^T -> fp32 [B, O]; w uint8 [O, I / n * bytes] in fmt's blocks
torch::Tensor blocks_linear(torch::Tensor x, torch::Tensor w, std::string fmt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous fp32 [B, I]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8 [O, bytes]");
  return kq::dispatch(fmt, [&](auto f) { return kq::linear<decltype(f)>(x, w); });
}

// w uint8 [O, I / n * bytes] in fmt's blocks -> fp32 [O, I], equal to gguf's dequantization bit for bit
torch::Tensor blocks_dequantize(torch::Tensor w, std::string fmt, int64_t in) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8 [O, bytes]");
  return kq::dispatch(fmt, [&](auto f) { return kq::dequant<decltype(f)>(w, in); });
}
