#pragma once  // included by lowbit_cpu.cpp, the one translation unit
#include "lowbit_cpu.h"

namespace {

// ---- int8 activations: llama.cpp's Q8_1 on the activation side (scales kept in fp32), integer dot products.
// Each activation row is quantized per block of 32 once per call (quantize_rows_i8):
//   d_x = amax / 127, q_x = roundf(x * (1 / d_x)) (halves away from zero; a zero block: d_x = 0, q_x = 0),
//   s_x = d_x * sum(q_x)   (ggml's quantize_row_q8_1_ref, the same fp32 operations in the same order).
// A block's dot product is then exact in int32: Q4_1 . Q8_1 = d_w d_x sum(q_w q_x) + m_w s_x and
// Q8_0 . Q8_1 = d_w d_x sum(q_w q_x); only the fp32 sum over blocks differs from the reference's order.
// Lanes are output rows: a tile of N rows (16 per AVX-512 vector, 8 per 256-bit one) is transposed once
// per call into a small buffer, vector j of block k holding each row's weights 4j..4j+3 as four bytes.
// One u8 x s8 dot-product step against an activation row's four q_x[4j..4j+3] (broadcast) then advances
// N outputs, eight steps a block, no horizontal sums; each tile is dotted with R activation rows at a time.
//   avx512vnni: vpdpbusd zmm; avxvnni: vpdpbusd ymm. q4 nibbles are the unsigned side; q8 weights are
//     stored as q + 128 (unsigned) and the block's int32 sum starts at -128 * sum(q_x), exact.
//   avx2: vpmaddubsw + vpmaddwd(ones). q4: eight steps summed in int16 (8 * 2 * 15 * 127 = 30480 < 2^15);
//     q8: the sign trick (|w| unsigned, sign(w) * q_x signed; a pair is at most 2 * 128 * 127 < 2^15).
//   scalar: the same integer sums, one weight at a time.
#if LOWBIT_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LOWBIT_I8 3
#elif LOWBIT_AVX2 && defined(__AVXVNNI__)
#define LOWBIT_I8 2
#elif LOWBIT_AVX2
#define LOWBIT_I8 1
#else
#define LOWBIT_I8 0
#endif

// the activations quantized per block: what quantize_rows_i8 returns, and each block's sum of q_x
struct ActI8 {
  torch::Tensor qx;  // int8 [B, I]
  torch::Tensor dx;  // fp32 [B, I/32]
  torch::Tensor sx;  // fp32 [B, I/32]: d_x * sum(q_x)
  torch::Tensor sq;  // int32 [B, I/32]: sum(q_x)
};

inline int32_t load4(const int8_t* p) {  // four int8 as one int32 (a broadcast operand)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// one block of 32 activations -> q [32], returns sum(q); d_x = amax / 127
inline int32_t quantize_block(const float* x, int8_t* q, float& dx) {
#if LOWBIT_AVX512
  const __m512i sign = _mm512_set1_epi32(int32_t(0x80000000u));
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  dx = amax / 127.f;
  const __m512 id = _mm512_set1_ps(dx != 0.f ? 1.f / dx : 0.f);
  auto rnd = [&](__m512 v) {  // roundf: trunc, then one step away from zero where the fraction is >= 0.5
    v = _mm512_mul_ps(v, id);
    const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 step = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(v), sign),
                                                            _mm512_castps_si512(_mm512_set1_ps(1.f))));
    return _mm512_cvtps_epi32(_mm512_mask_add_ps(t, up, t, step));
  };
  const __m512i qa = rnd(a), qb = rnd(b);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#elif LOWBIT_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  dx = amax / 127.f;
  const __m256 id = _mm256_set1_ps(dx != 0.f ? 1.f / dx : 0.f);
  __m256i qi[4];
  for (int j = 0; j < 4; ++j) {
    const __m256 s = _mm256_mul_ps(v[j], id);
    const __m256 t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(s, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 step = _mm256_or_ps(_mm256_and_ps(s, sign), _mm256_set1_ps(1.f));
    qi[j] = _mm256_cvtps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, step)));
  }
  // int32 -> int8 (packs interleave 128-bit lanes; the permute puts them back in order)
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  return _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
#else
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  dx = amax / 127.f;
  const float id = dx != 0.f ? 1.f / dx : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < QK; ++j) sum += q[j] = int8_t(std::roundf(x[j] * id));
  return sum;
#endif
}

ActI8 quantize_act(const torch::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be fp32 or bf16 [B, I], got ", x_in.scalar_type(), " ", x_in.sizes());
  const auto x = x_in.to(at::kFloat).contiguous();
  const int64_t b = x.size(0), in = x.size(1), g = in / QK;
  TORCH_CHECK(in % QK == 0, "in_features ", in, " is not a multiple of ", QK);
  ActI8 a{torch::empty({b, in}, x.options().dtype(at::kChar)), torch::empty({b, g}, x.options()),
          torch::empty({b, g}, x.options()), torch::empty({b, g}, x.options().dtype(at::kInt))};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = a.qx.data_ptr<int8_t>();
  float *dp = a.dx.data_ptr<float>(), *sp = a.sx.data_ptr<float>();
  int32_t* sqp = a.sq.data_ptr<int32_t>();
  at::parallel_for(0, b * g, std::max<int64_t>(1, 16384 / QK), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      sqp[k] = quantize_block(xp + k * QK, qp + k * QK, dp[k]);
      sp[k] = dp[k] * float(sqp[k]);
    }
  });
  return a;
}

#if LOWBIT_I8 >= 1
// in each 128-bit lane, a 4x4 transpose of 32-bit elements: a' = (a0 b0 c0 d0), b' = (a1 b1 c1 d1), ...
#define LOWBIT_TRANSPOSE4(W, a, b, c, d)                                                              \
  do {                                                                                                \
    const auto t0 = W##_unpacklo_epi32(a, b), t1 = W##_unpackhi_epi32(a, b);                          \
    const auto t2 = W##_unpacklo_epi32(c, d), t3 = W##_unpackhi_epi32(c, d);                          \
    a = W##_unpacklo_epi64(t0, t2), b = W##_unpackhi_epi64(t0, t2);                                   \
    c = W##_unpacklo_epi64(t1, t3), d = W##_unpackhi_epi64(t1, t3);                                   \
  } while (0)

// 256-bit vectors: 8 output rows a tile. VNNI: vpdpbusd ymm; else maddubs + madd.
struct Ymm {
  using I = __m256i;
  using F = __m256;
  static constexpr int N = 8;
  static constexpr bool kOffsetQ8 = LOWBIT_I8 == 2;  // q8 stored as q + 128, sums start at -128 * sum(q_x)
  static I load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(void* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I nibble_lo(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I nibble_hi(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  static I offset(I v) { return _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80))); }
  // rows a and a + 4 of the tile (row pointers rp), 16 bytes each at byte offset off
  static I rows(const uint8_t* const* rp, int a, int64_t off) {
    const auto lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[a] + off));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[a + 4] + off)), 1);
  }
  static void transpose4(I v[4]) { LOWBIT_TRANSPOSE4(_mm256, v[0], v[1], v[2], v[3]); }
  // v[i] (i < 8) -> v[k]: element i of v[k] is element k of the old v[i]
  static void transpose(F v[8]) {
    I t[8];
    for (int i = 0; i < 8; ++i) t[i] = _mm256_castps_si256(v[i]);
    transpose4(t);
    transpose4(t + 4);
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_castsi256_ps(_mm256_permute2x128_si256(t[j], t[4 + j], 0x20));
      v[4 + j] = _mm256_castsi256_ps(_mm256_permute2x128_si256(t[j], t[4 + j], 0x31));
    }
  }
  static F halves(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // a block's int32 sums: q4 in int16 over the 8 steps (see the header), q8 the sign trick; VNNI exact in int32
  template <bool Q4> static I prep(I w) { return Q4 || LOWBIT_I8 == 2 ? w : _mm256_abs_epi8(w); }
  template <bool Q4> static I dot(I acc, I wu, I w, I x) {
#if LOWBIT_I8 == 2
    (void)w;
    return _mm256_dpbusd_avx_epi32(acc, wu, x);
#else
    if (Q4) return _mm256_add_epi16(acc, _mm256_maddubs_epi16(wu, x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wu, _mm256_sign_epi8(x, w)),
                                                   _mm256_set1_epi16(1)));
#endif
  }
  template <bool Q4> static I finish(I acc) {
    return Q4 && LOWBIT_I8 == 1 ? _mm256_madd_epi16(acc, _mm256_set1_epi16(1)) : acc;
  }
  static F zerof() { return _mm256_setzero_ps(); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F setf(float v) { return _mm256_set1_ps(v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void storef(float* p, F v, int n) {
    if (n == N) return _mm256_storeu_ps(p, v);
    alignas(32) float t[N];
    _mm256_store_ps(t, v);
    std::memcpy(p, t, n * sizeof(float));
  }
};

#if LOWBIT_I8 == 3
// 512-bit vectors: 16 output rows a tile, vpdpbusd zmm
struct Zmm {
  using I = __m512i;
  using F = __m512;
  static constexpr int N = 16;
  static constexpr bool kOffsetQ8 = true;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static void store(void* p, I v) { _mm512_storeu_si512(p, v); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I nibble_lo(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I nibble_hi(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  static I offset(I v) { return _mm512_xor_si512(v, _mm512_set1_epi8(char(0x80))); }
  // rows a, a + 4, a + 8, a + 12 of the tile, 16 bytes each at byte offset off, one per 128-bit lane
  static I rows(const uint8_t* const* rp, int a, int64_t off) {
    auto ld = [&](int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[i] + off)); };
    I v = _mm512_castsi128_si512(ld(a));
    v = _mm512_inserti32x4(v, ld(a + 4), 1);
    v = _mm512_inserti32x4(v, ld(a + 8), 2);
    return _mm512_inserti32x4(v, ld(a + 12), 3);
  }
  static void transpose4(I v[4]) { LOWBIT_TRANSPOSE4(_mm512, v[0], v[1], v[2], v[3]); }
  static void transpose(F v[16]) {  // 16x16: 4x4 inside the 128-bit lanes, then 4x4 of the lanes
    I t[16];
    for (int i = 0; i < 16; ++i) t[i] = _mm512_castps_si512(v[i]);
    for (int a = 0; a < 16; a += 4) transpose4(t + a);
    for (int j = 0; j < 4; ++j) {
      const I u0 = _mm512_shuffle_i32x4(t[j], t[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(t[j], t[4 + j], 0xEE);
      const I u2 = _mm512_shuffle_i32x4(t[8 + j], t[12 + j], 0x44);
      const I u3 = _mm512_shuffle_i32x4(t[8 + j], t[12 + j], 0xEE);
      v[j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(u0, u2, 0x88));
      v[4 + j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(u0, u2, 0xDD));
      v[8 + j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(u1, u3, 0x88));
      v[12 + j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(u1, u3, 0xDD));
    }
  }
  static F halves(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  template <bool Q4> static I prep(I w) { return w; }
  template <bool Q4> static I dot(I acc, I wu, I, I x) { return _mm512_dpbusd_epi32(acc, wu, x); }
  template <bool Q4> static I finish(I acc) { return acc; }
  static F zerof() { return _mm512_setzero_ps(); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F setf(float v) { return _mm512_set1_ps(v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void storef(float* p, F v, int n) { _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1), v); }
};
using VecI8 = Zmm;
constexpr int kRowTile = 8;  // activation rows a tile: 8 sums + 8 accumulators of the 32 registers
#else
using VecI8 = Ymm;
constexpr int kRowTile = 4;  // 16 registers
#endif

// A tile of S::N output rows from row o (the last row repeated past `out`), transposed:
// wt [G, 8, N, 4] u8: wt[k, j, n, :] = q of row o + n, block k, elements 4j..4j+3 (q4: 0..15; q8: q + 128
// where S::kOffsetQ8, else q); dws, mws [Gpad, N] fp32: d and m of row o + n, block k.
template <class S, bool Q4>
void pack_tile(const uint8_t* qp, const at::Half* dp, const at::Half* mp, int64_t out, int64_t g, int64_t o,
               uint8_t* wt, float* dws, float* mws) {
  constexpr int N = S::N;
  const int64_t bpb = Q4 ? QK / 2 : QK;
  const uint8_t* rp[N];
  for (int n = 0; n < N; ++n) rp[n] = qp + std::min(o + n, out - 1) * g * bpb;
  for (int64_t k = 0; k < g; ++k) {
    typename S::I* w = reinterpret_cast<typename S::I*>(wt + k * 8 * N * 4);
    for (int half = 0; half < (Q4 ? 1 : 2); ++half) {
      typename S::I t[4];
      for (int a = 0; a < 4; ++a) t[a] = S::rows(rp, a, k * bpb + 16 * half);
      S::transpose4(t);  // t[j]: each row's bytes 4j..4j+3 (+16 * half)
      for (int j = 0; j < 4; ++j) {
        if (Q4) {
          S::store(w + j, S::nibble_lo(t[j]));      // elements 4j..4j+3
          S::store(w + 4 + j, S::nibble_hi(t[j]));  // elements 16+4j..16+4j+3
        } else {
          S::store(w + 4 * half + j, S::kOffsetQ8 ? S::offset(t[j]) : t[j]);
        }
      }
    }
  }
  // scales: N rows x N blocks at a time, transposed in registers ([N, G] fp16 -> [G, N] fp32)
  for (int plane = 0; plane < (Q4 ? 2 : 1); ++plane) {
    const at::Half* src = plane == 0 ? dp : mp;
    float* dst = plane == 0 ? dws : mws;
    for (int64_t k0 = 0; k0 < g; k0 += N) {
      typename S::F v[N];
      for (int n = 0; n < N; ++n) {
        const at::Half* row = src + std::min(o + n, out - 1) * g + k0;
        if (k0 + N <= g) {
          v[n] = S::halves(row);
        } else {
          at::Half tail[N];
          for (int i = 0; i < N; ++i) tail[i] = k0 + i < g ? row[i] : at::Half(0.f);
          v[n] = S::halves(tail);
        }
      }
      S::transpose(v);
      for (int i = 0; i < N; ++i) std::memcpy(dst + (k0 + i) * N, &v[i], sizeof(v[i]));
    }
  }
}

// y[r, o : o + n] for R activation rows (row stride in) against a packed tile
template <class S, bool Q4, int R>
void dot_tile(const uint8_t* wt, const float* dws, const float* mws, int64_t g, int64_t in, const int8_t* qx,
              const float* dx, const float* sx, const int32_t* sq, float* y, int64_t out, int n) {
  using I = typename S::I;
  using F = typename S::F;
  constexpr int N = S::N;
  // int32 sums per row and block: with few rows (AVX-512), even and odd steps apart hide vpdpbusd's latency
  constexpr int P = N == 16 && R <= 4 ? 2 : 1;
  F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = S::zerof();
  for (int64_t k = 0; k < g; ++k) {
    I s[P][R];
    for (int r = 0; r < R; ++r) {
      s[0][r] = !Q4 && S::kOffsetQ8 ? S::set1(-128 * sq[r * g + k]) : S::zero();
      if (P == 2) s[P - 1][r] = S::zero();
    }
    const uint8_t* wk = wt + k * 8 * N * 4;
    const int8_t* xk = qx + k * QK;
    for (int j = 0; j < 8; ++j) {
      const I w = S::load(wk + j * N * 4);
      const I wu = S::template prep<Q4>(w);
      for (int r = 0; r < R; ++r)
        s[j % P][r] = S::template dot<Q4>(s[j % P][r], wu, w, S::set1(load4(xk + r * in + 4 * j)));
    }
    const F dw = S::loadf(dws + k * N);
    for (int r = 0; r < R; ++r) {
      I t = S::template finish<Q4>(s[0][r]);
      if (P == 2) t = S::add(t, S::template finish<Q4>(s[P - 1][r]));
      acc[r] = S::fmadd(S::cvt(t), S::mul(dw, S::setf(dx[r * g + k])), acc[r]);
      if (Q4) acc[r] = S::fmadd(S::loadf(mws + k * N), S::setf(sx[r * g + k]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) S::storef(y + r * out, acc[r], n);
}

template <class S, bool Q4, int R>
void dot_rest(int rest, const uint8_t* wt, const float* dws, const float* mws, int64_t g, int64_t in,
              const int8_t* qx, const float* dx, const float* sx, const int32_t* sq, float* y, int64_t out, int n) {
  if constexpr (R > 1) {
    if (rest == R - 1) return dot_tile<S, Q4, R - 1>(wt, dws, mws, g, in, qx, dx, sx, sq, y, out, n);
    return dot_rest<S, Q4, R - 1>(rest, wt, dws, mws, g, in, qx, dx, sx, sq, y, out, n);
  }
}
#endif

template <bool Q4>
torch::Tensor lowbit_linear_i8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                               const at::Half* mp) {
  const auto xf = x.to(at::kFloat).contiguous();  // bf16 activations are quantized from fp32
  check(xf, qs, d, Q4 ? QK / 2 : QK);
  const ActI8 a = quantize_act(xf);
  const int64_t b = x.size(0), in = x.size(1), g = in / QK, out = qs.size(0);
  auto y = torch::empty({b, out}, a.dx.options());
  const int8_t* qx = a.qx.data_ptr<int8_t>();
  const float *dx = a.dx.data_ptr<float>(), *sx = a.sx.data_ptr<float>();
  const int32_t* sq = a.sq.data_ptr<int32_t>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const at::Half* dp = d.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
#if LOWBIT_I8 >= 1
  using S = VecI8;
  constexpr int N = S::N, R = kRowTile;
  const int64_t tiles = (out + N - 1) / N, gpad = (g + N - 1) / N * N;
  at::parallel_for(0, tiles, std::max<int64_t>(1, 64 / N), [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> wt(g * 8 * N * 4);  // the packed tile: 16 KB at I = 1024 (N = 16)
    std::vector<float> dws(gpad * N), mws(Q4 ? gpad * N : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o = t * N;
      const int n = int(std::min<int64_t>(N, out - o));
      pack_tile<S, Q4>(qp, dp, mp, out, g, o, wt.data(), dws.data(), mws.data());
      int64_t r = 0;
      for (; r + R <= b; r += R)
        dot_tile<S, Q4, R>(wt.data(), dws.data(), mws.data(), g, in, qx + r * in, dx + r * g, sx + r * g, sq + r * g,
                           yp + r * out + o, out, n);
      if (r < b)
        dot_rest<S, Q4, R>(int(b - r), wt.data(), dws.data(), mws.data(), g, in, qx + r * in, dx + r * g, sx + r * g,
                           sq + r * g, yp + r * out + o, out, n);
    }
  });
#else
  (void)sq;
  at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o)
      for (int64_t r = 0; r < b; ++r) {
        float acc = 0.f;
        for (int64_t k = 0; k < g; ++k) {
          const int8_t* xr = qx + r * in + k * QK;
          int32_t s = 0;
          if (Q4) {
            const uint8_t* blk = qp + (o * g + k) * (QK / 2);
            for (int64_t j = 0; j < QK / 2; ++j) s += (blk[j] & 0x0F) * xr[j] + (blk[j] >> 4) * xr[j + QK / 2];
          } else {
            const int8_t* blk = reinterpret_cast<const int8_t*>(qp) + (o * g + k) * QK;
            for (int64_t j = 0; j < QK; ++j) s += blk[j] * xr[j];
          }
          acc += float(s) * (h2f(dp[o * g + k]) * dx[r * g + k]);
          if (Q4) acc += h2f(mp[o * g + k]) * sx[r * g + k];
        }
        yp[r * out + o] = acc;
      }
  });
#endif
  return y;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows_i8(torch::Tensor x) {
  const ActI8 a = quantize_act(x);
  return {a.qx, a.dx, a.sx};
}

torch::Tensor q4_linear_i8(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(qs.scalar_type() == at::kByte, "q4 qs must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == at::kHalf && m.is_contiguous(), "m must match d");
  return lowbit_linear_i8<true>(x, qs, d, m.data_ptr<at::Half>());
}

torch::Tensor q8_linear_i8(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  TORCH_CHECK(qs.scalar_type() == at::kChar, "q8 qs must be int8");
  return lowbit_linear_i8<false>(x, qs, d, nullptr);
}


const char* simd_i8() {
  return LOWBIT_I8 == 3 ? "avx512vnni" : LOWBIT_I8 == 2 ? "avxvnni" : LOWBIT_I8 == 1 ? "avx2" : "scalar";
}
