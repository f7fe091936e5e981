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
// q4_linear_i8 / q8_linear_i8 (further down) quantize the activations to int8 per block instead and take
// integer dot products (VNNI or vpmaddubsw): llama.cpp's way, a lossy format, about 0.5% on random data.
#include "lowbit_cpu.h"

namespace {


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


// a block's 32 weights as four vectors of 8 floats (the integers q, before the scale). Each 8 bytes are widened
// straight from memory (vpmovzxbd ymm, m64) and the nibbles split in 32-bit lanes: 2 port-5 shuffles per block
// where widening a register's halves took 6 (4 widenings and 2 byte shifts), the bound on AVX2 cores
inline void unpack_q4(const uint8_t* blk, __m256 q[4]) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 8)));
  q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
  q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
  q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
  q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

inline void unpack_q8(const int8_t* blk, __m256 q[4]) {
  for (int j = 0; j < 4; ++j)
    q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 8 * j))));
}

// the weights of the output row LOWBIT_PREFETCH_ROWS rows on (all its cache lines) into cache while this one
// computes (8: the best of 2, 4, 8, 16 measured, kernels/README.md): the
// hardware prefetchers alone leave a row-by-row stream short of the memory's bandwidth
#ifndef LOWBIT_PREFETCH_ROWS
#define LOWBIT_PREFETCH_ROWS 8
#endif
inline void prefetch_ahead(const uint8_t* row, int64_t bytes) {
  for (int64_t ahead = 0; ahead < bytes; ahead += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + LOWBIT_PREFETCH_ROWS * bytes + ahead), _MM_HINT_T0);
}

// Block scales as fp32 for n output rows from o on: d into dv [n * g] and, for q4, m into mv (one pass over the
// tile's contiguous halves: no scalar tail per row)
template <bool Q4>
inline void row_scales(const at::Half* dp, const at::Half* mp, int64_t o, int64_t n, int64_t g, float* dv, float* mv) {
  halves_to_f32(dp + o * g, n * g, dv);
  if (Q4) halves_to_f32(mp + o * g, n * g, mv);
}

// One activation row's outputs for a tile of n rows: the row sums ys plus, for q4, the minimum's term (dot(m, xs):
// its lanes' sum ms, then its scalar tail from `tail`), in dot()'s order
template <bool Q4>
inline void row1_tile_out(const float* ys, const float* ms, const float* mv, const float* xs, int64_t tail, int64_t g,
                          int64_t n, float* y) {
  for (int64_t r = 0; r < n; ++r) {
    float accm = 0.f;
    if (Q4) {
      accm = ms[r];
      for (int64_t i = tail; i < g; ++i) accm += mv[r * g + i] * xs[i];
    }
    y[r] = ys[r] + accm;
  }
}

// Output rows [o0, o1) for NB activation rows x[0..NB) (stride in); accumulators live in registers.
// A block's weights are formed once (w = q * d + m, one FMA per vector) and shared by the NB rows;
// even and odd blocks accumulate separately to hide the FMA latency.
#if LOWBIT_AVX512
// A q4 block's 16 bytes widened to 16 dwords: the low nibble of each is element j's index, (>> 4) element j + 16's.
// A nibble becomes a float by a permute of a 16-entry table (vpermps reads an index's low 4 bits alone) rather than
// an AND and an int-to-float conversion: with 512-bit work in flight only ports 0 and 5 take vector uops, and
// the table drops a block's unpacking from 7 of them to 4 (same values: the table holds the same floats).
inline __m512i q4_nibbles_512(const uint8_t* blk) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
}

inline __m512 q4_table_iota() {
  return _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
}

// a q4 block's 32 integers as fp32, elements 0..15 in q0 (low nibbles) and 16..31 in q1 (high nibbles)
inline void unpack_q4_512(const uint8_t* blk, __m512& q0, __m512& q1) {
  const __m512i raw = q4_nibbles_512(blk);
  const __m512 iota = q4_table_iota();
  q0 = _mm512_permutexvar_ps(raw, iota);
  q1 = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), iota);
}

// a block's 32 weights in fp32, elements 0..15 in w0 and 16..31 in w1: w = d * q + m (q4) or d * q (q8). q4: the
// block's 16 possible weights fma(i, d, m) are formed once and permuted into place (the same bits as fma(q, d, m))
template <bool Q4>
inline void block_weights_512(const uint8_t* blk, float d, float m, __m512& w0, __m512& w1) {
  const __m512 vd = _mm512_set1_ps(d);
  if (Q4) {
    const __m512 table = _mm512_fmadd_ps(q4_table_iota(), vd, _mm512_set1_ps(m));
    const __m512i raw = q4_nibbles_512(blk);
    w0 = _mm512_permutexvar_ps(raw, table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
  } else {
    const __m128i* b = reinterpret_cast<const __m128i*>(blk);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b))), vd);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b + 1))), vd);
  }
}

template <int NB, bool Q4>
void rows_simd(const float* x, int64_t in, const uint8_t* qp, const at::Half* dp, const at::Half* mp, float* y,
               int64_t out, int64_t o0, int64_t o1) {
  // output rows in tiles of 16, as row1_simd: the tile's scales converted in one pass, each activation row's 16
  // sums added across lanes together (hsum16x16, the same bits as hsum16 row by row)
  constexpr int64_t R = 16;
  const int64_t g = in / QK, bpb = Q4 ? QK / 2 : QK;
  std::vector<float> dv(R * g), mv(Q4 ? R * g : 0);
  __m512 sums[NB][R];
  for (int64_t t0 = o0; t0 < o1; t0 += R) {
    const int64_t n = std::min(R, o1 - t0);
    row_scales<Q4>(dp, mp, t0, n, g, dv.data(), mv.data());
    for (int64_t i = 0; i < n; ++i) {
      const float* d = dv.data() + i * g;
      const float* m = Q4 ? mv.data() + i * g : nullptr;
      // even and odd blocks in two register sets, unrolled by hand: an accumulator indexed by (k & 1) at run
      // time lives in memory, a load and a store around every FMA (the extra rows cost twice as much)
      __m512 acc0[NB], acc1[NB];
      for (int r = 0; r < NB; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
      const uint8_t* row = qp + (t0 + i) * g * bpb;
      prefetch_ahead(row, g * bpb);
      auto block = [&](int64_t k, __m512* acc) {
        __m512 w0, w1;
        block_weights_512<Q4>(row + k * bpb, d[k], Q4 ? m[k] : 0.f, w0, w1);
        for (int r = 0; r < NB; ++r) {
          const float* xr = x + r * in + k * QK;
          acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r]);
          acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r]);
        }
      };
      int64_t k = 0;
      for (; k + 2 <= g; k += 2) {
        block(k, acc0);
        block(k + 1, acc1);
      }
      if (k < g) block(k, acc0);
      for (int r = 0; r < NB; ++r) sums[r][i] = _mm512_add_ps(acc0[r], acc1[r]);
    }
    for (int r = 0; r < NB; ++r) {
      if (n == R) {
        _mm512_storeu_ps(y + r * out + t0, hsum16x16(sums[r]));
      } else {
        for (int64_t i = 0; i < n; ++i) y[r * out + t0 + i] = hsum16(sums[r][i]);
      }
    }
  }
}

// One activation row: the minimum's term is m * sum(x) over the block (block sums precomputed). Output rows
// go in tiles of 16: the tile's scales are converted to fp32 in one pass (no scalar tails per row), a block
// costs one widening, two permutes (unpack_q4_512), a multiply and two FMAs with its scale a broadcast from
// memory, and the tile's 16 sums (and its 16 minimum terms) are added across lanes together (hsum16x16: the
// same bits as one row at a time, so a row's value does not depend on where a thread's range starts).
template <bool Q4>
void row1_simd(const float* x, const float* xs, int64_t in, const uint8_t* qp, const at::Half* dp,
               const at::Half* mp, float* y, int64_t o0, int64_t o1) {
  constexpr int64_t R = 16;
  const int64_t g = in / QK, bpb = Q4 ? QK / 2 : QK;
  std::vector<float> dv(R * g), mv(Q4 ? R * g : 0);
  __m512 sums[R], msums[R];
  alignas(64) float ys[R], ms[R];
  int64_t tail = g;
  for (int64_t t0 = o0; t0 < o1; t0 += R) {
    const int64_t n = std::min(R, o1 - t0);
    row_scales<Q4>(dp, mp, t0, n, g, dv.data(), mv.data());
    for (int64_t r = 0; r < n; ++r) {
      const float* d = dv.data() + r * g;
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      const uint8_t* row = qp + (t0 + r) * g * bpb;
      prefetch_ahead(row, g * bpb);
      auto block = [&](int64_t kk, __m512& acc) {
        __m512 q0, q1;
        if (Q4) {
          unpack_q4_512(row + kk * bpb, q0, q1);
        } else {
          const __m128i* b = reinterpret_cast<const __m128i*>(row + kk * bpb);
          q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b)));
          q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b + 1)));
        }
        const float* xr = x + kk * QK;
        const __m512 t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xr)));
        acc = _mm512_fmadd_ps(t, _mm512_set1_ps(d[kk]), acc);
      };
      int64_t k = 0;
      for (; k + 2 <= g; k += 2) {
        block(k, acc0);
        block(k + 1, acc1);
      }
      if (k < g) block(k, acc0);
      sums[r] = _mm512_add_ps(acc0, acc1);
      if (Q4) msums[r] = dot_lanes(mv.data() + r * g, xs, g, &tail);  // dot(m, xs)'s lanes
    }
    if (n == R) {
      _mm512_store_ps(ys, hsum16x16(sums));
      if (Q4) _mm512_store_ps(ms, hsum16x16(msums));
    } else {
      for (int64_t r = 0; r < n; ++r) {
        ys[r] = hsum16(sums[r]);
        if (Q4) ms[r] = hsum16(msums[r]);
      }
    }
    row1_tile_out<Q4>(ys, ms, mv.data(), xs, tail, g, n, y + t0);
  }
}
#else
// AVX2: output rows in tiles of 8, each activation row's 8 sums added across lanes together (hsum8x8, the same
// bits as hsum row by row), the tile's scales converted in one pass
template <int NB, bool Q4>
void rows_simd(const float* x, int64_t in, const uint8_t* qp, const at::Half* dp, const at::Half* mp, float* y,
               int64_t out, int64_t o0, int64_t o1) {
  constexpr int64_t R = 8;
  const int64_t g = in / QK, bpb = Q4 ? QK / 2 : QK;
  std::vector<float> dv(R * g), mv(Q4 ? R * g : 0);
  __m256 sums[NB][R];
  for (int64_t t0 = o0; t0 < o1; t0 += R) {
    const int64_t n = std::min(R, o1 - t0);
    row_scales<Q4>(dp, mp, t0, n, g, dv.data(), mv.data());
    for (int64_t i = 0; i < n; ++i) {
      const float* d = dv.data() + i * g;
      const float* m = Q4 ? mv.data() + i * g : nullptr;
      // P == 2: even and odd blocks, unrolled by hand (see the AVX-512 rows_simd); P == 1 for tiles of 8, whose
      // rows are enough independent sums to hide the FMA latency and whose registers (16) hold one set only
      constexpr int P = NB >= 8 ? 1 : 2;
      __m256 acc0[NB], acc1[NB];
      for (int r = 0; r < NB; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
      const uint8_t* row = qp + (t0 + i) * g * bpb;
      prefetch_ahead(row, g * bpb);
      auto block = [&](int64_t k, __m256* acc) {
        __m256 w[4];
        if (Q4) unpack_q4(row + k * bpb, w); else unpack_q8(reinterpret_cast<const int8_t*>(row + k * bpb), w);
        const __m256 vd = _mm256_set1_ps(d[k]);
        const __m256 vm = _mm256_set1_ps(Q4 ? m[k] : 0.f);
        for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(w[j], vd, vm);
        for (int r = 0; r < NB; ++r) {
          const float* xr = x + r * in + k * QK;
          for (int j = 0; j < 4; ++j) acc[r] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), acc[r]);
        }
      };
      int64_t k = 0;
      if (P == 2)
        for (; k + 2 <= g; k += 2) {
          block(k, acc0);
          block(k + 1, acc1);
        }
      for (; k < g; ++k) block(k, acc0);
      for (int r = 0; r < NB; ++r) sums[r][i] = P == 1 ? acc0[r] : _mm256_add_ps(acc0[r], acc1[r]);
    }
    for (int r = 0; r < NB; ++r) {
      if (n == R) {
        _mm256_storeu_ps(y + r * out + t0, hsum8x8(sums[r]));
      } else {
        for (int64_t i = 0; i < n; ++i) y[r * out + t0 + i] = hsum(sums[r][i]);
      }
    }
  }
}

// One activation row (see the AVX-512 row1_simd): two conversions' worth of work per 8 weights, the minimum's
// term through block sums, two accumulators; tiles of 8 output rows as rows_simd.
template <bool Q4>
void row1_simd(const float* x, const float* xs, int64_t in, const uint8_t* qp, const at::Half* dp,
               const at::Half* mp, float* y, int64_t o0, int64_t o1) {
  constexpr int64_t R = 8;
  const int64_t g = in / QK, bpb = Q4 ? QK / 2 : QK;
  std::vector<float> dv(R * g), mv(Q4 ? R * g : 0);
  __m256 sums[R], msums[R];
  alignas(32) float ys[R], ms[R];
  int64_t tail = g;
  for (int64_t t0 = o0; t0 < o1; t0 += R) {
    const int64_t n = std::min(R, o1 - t0);
    row_scales<Q4>(dp, mp, t0, n, g, dv.data(), mv.data());
    for (int64_t r = 0; r < n; ++r) {
      const float* d = dv.data() + r * g;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      const uint8_t* row = qp + (t0 + r) * g * bpb;
      prefetch_ahead(row, g * bpb);
      auto block = [&](int64_t kk, __m256& acc) {
        __m256 q[4];
        if (Q4) unpack_q4(row + kk * bpb, q); else unpack_q8(reinterpret_cast<const int8_t*>(row + kk * bpb), q);
        const float* xr = x + kk * QK;
        __m256 u0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
        __m256 u1 = _mm256_mul_ps(q[1], _mm256_loadu_ps(xr + 8));
        u0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16), u0);
        u1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), u1);
        acc = _mm256_fmadd_ps(_mm256_add_ps(u0, u1), _mm256_set1_ps(d[kk]), acc);
      };
      int64_t k = 0;
      for (; k + 2 <= g; k += 2) {
        block(k, acc0);
        block(k + 1, acc1);
      }
      if (k < g) block(k, acc0);
      sums[r] = _mm256_add_ps(acc0, acc1);
      if (Q4) msums[r] = dot_lanes8(mv.data() + r * g, xs, g, &tail);  // dot(m, xs)'s lanes
    }
    if (n == R) {
      _mm256_store_ps(ys, hsum8x8(sums));
      if (Q4) _mm256_store_ps(ms, hsum8x8(msums));
    } else {
      for (int64_t r = 0; r < n; ++r) {
        ys[r] = hsum(sums[r]);
        if (Q4) ms[r] = hsum(msums[r]);
      }
    }
    row1_tile_out<Q4>(ys, ms, mv.data(), xs, tail, g, n, y + t0);
  }
}
#endif
#endif

// scalar rows for machines without AVX2 (same math, same order of the d * (q . x) + m * sum(x) split)
template <bool Q4>
void rows_scalar(const float* x, const float* xs, int64_t nb, int64_t in, const uint8_t* qp, const at::Half* dp,
                 const at::Half* mp, float* y, int64_t out, int64_t o0, int64_t o1) {
  const int64_t g = in / QK, bpb = Q4 ? QK / 2 : QK;
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t r = 0; r < nb; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < g; ++k) {
        const uint8_t* blk = qp + (o * g + k) * bpb;
        const float* xr = x + r * in + k * QK;
        float s = 0.f;
        if (Q4) {
          for (int64_t j = 0; j < QK / 2; ++j) s += (blk[j] & 0x0F) * xr[j] + (blk[j] >> 4) * xr[j + QK / 2];
          acc += h2f(dp[o * g + k]) * s + h2f(mp[o * g + k]) * xs[r * g + k];
        } else {
          const int8_t* b8 = reinterpret_cast<const int8_t*>(blk);
          for (int64_t j = 0; j < QK; ++j) s += b8[j] * xr[j];
          acc += h2f(dp[o * g + k]) * s;
        }
      }
      y[r * out + o] = acc;
    }
}

template <bool Q4>
torch::Tensor lowbit_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                            const at::Half* mp) {
  const int64_t b = x.size(0), in = x.size(1), out = qs.size(0);
  auto y = torch::empty({b, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const at::Half* dp = d.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const std::vector<float> xs = b == 1 ? block_sums(xp, 1, in) : std::vector<float>();
  at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
#if LOWBIT_AVX2
    int64_t r = 0;  // activation rows in tiles of 8 (AVX2: then of 4), then the rest in one pass
#if LOWBIT_AVX512
    for (; r + 8 <= b; r += 8) rows_simd<8, Q4>(xp + r * in, in, qp, dp, mp, yp + r * out, out, o0, o1);
#else
    for (; r + 8 <= b; r += 8) rows_simd<8, Q4>(xp + r * in, in, qp, dp, mp, yp + r * out, out, o0, o1);
    for (; r + 4 <= b; r += 4) rows_simd<4, Q4>(xp + r * in, in, qp, dp, mp, yp + r * out, out, o0, o1);
#endif
    const float* xr = xp + r * in;
    float* yr = yp + r * out;
    switch (b - r) {
#if LOWBIT_AVX512
      case 7: rows_simd<7, Q4>(xr, in, qp, dp, mp, yr, out, o0, o1); break;
      case 6: rows_simd<6, Q4>(xr, in, qp, dp, mp, yr, out, o0, o1); break;
      case 5: rows_simd<5, Q4>(xr, in, qp, dp, mp, yr, out, o0, o1); break;
      case 4: rows_simd<4, Q4>(xr, in, qp, dp, mp, yr, out, o0, o1); break;
#endif
      case 3: rows_simd<3, Q4>(xr, in, qp, dp, mp, yr, out, o0, o1); break;
      case 2: rows_simd<2, Q4>(xr, in, qp, dp, mp, yr, out, o0, o1); break;
      case 1:
        if (b == 1) row1_simd<Q4>(xr, xs.data(), in, qp, dp, mp, yr, o0, o1);
        else rows_simd<1, Q4>(xr, in, qp, dp, mp, yr, out, o0, o1);
        break;
      default: break;
    }
#else
    const std::vector<float> xs = block_sums(xp, b, in);  // per chunk: cheap, and only without SIMD
    rows_scalar<Q4>(xp, xs.data(), b, in, qp, dp, mp, yp, out, o0, o1);
#endif
  });
  return y;
}

}  // namespace

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  check(x, qs, d, QK / 2);
  TORCH_CHECK(qs.scalar_type() == at::kByte, "q4 qs must be uint8");
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == at::kHalf && m.is_contiguous(), "m must match d");
  return lowbit_linear<true>(x, qs, d, m.data_ptr<at::Half>());
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  TORCH_CHECK(qs.scalar_type() == at::kChar, "q8 qs must be int8");
  check(x, qs, d, QK);
  return lowbit_linear<false>(x, qs, d, nullptr);
}

// ---- bf16 activations on CPUs with avx512_bf16: each block's weights are formed once in fp32
// (w = d * q + m), rounded to bf16 (what a bf16 engine holds for the same weights) and shared by the
// rows, each row one dot-product instruction per block (vdpbf16ps: 32 multiply-adds, fp32 sums),
// twice the multiply-adds per instruction of the fp32 path. x bf16 [B, I] -> y fp32 [B, O].
#if LOWBIT_AVX512 && defined(__AVX512BF16__)
#define LOWBIT_BF16 1
template <int NB, bool Q4>
void rows_bf16(const at::BFloat16* x, int64_t in, const uint8_t* qp, const at::Half* dp, const at::Half* mp,
               float* y, int64_t out, int64_t o0, int64_t o1) {
  constexpr int P = NB >= 8 ? 1 : 2;  // accumulators per row: few rows need two to hide the latency
  const int64_t g = in / QK, bpb = Q4 ? QK / 2 : QK;
  std::vector<float> dv(g), mv(g);
  for (int64_t o = o0; o < o1; ++o) {
    row_scales<Q4>(dp, mp, o, 1, g, dv.data(), mv.data());
    __m512 acc0[NB], acc1[NB];  // P == 2: even and odd blocks, unrolled by hand (see rows_simd)
    for (int r = 0; r < NB; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    const uint8_t* row = qp + o * g * bpb;
    prefetch_ahead(row, g * bpb);
    auto block = [&](int64_t k, __m512* acc) {
      __m512 w0, w1;
      block_weights_512<Q4>(row + k * bpb, dv[k], Q4 ? mv[k] : 0.f, w0, w1);
      const __m512bh wb = _mm512_cvtne2ps_pbh(w1, w0);  // elements 0..15 from w0, 16..31 from w1
      for (int r = 0; r < NB; ++r) {
        const __m512bh xb = (__m512bh)_mm512_loadu_si512(x + r * in + k * QK);
        acc[r] = _mm512_dpbf16_ps(acc[r], wb, xb);
      }
    };
    int64_t k = 0;
    if (P == 2)
      for (; k + 2 <= g; k += 2) {
        block(k, acc0);
        block(k + 1, acc1);
      }
    for (; k < g; ++k) block(k, acc0);  // P == 1: every block; P == 2: the odd count's last (even) block
    for (int r = 0; r < NB; ++r)
      y[r * out + o] = hsum16(P == 1 ? acc0[r] : _mm512_add_ps(acc0[r], acc1[r]));
  }
}

template <bool Q4>
torch::Tensor lowbit_linear_bf16(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                                 const at::Half* mp) {
  const int64_t b = x.size(0), in = x.size(1), out = qs.size(0);
  auto y = torch::empty({b, out}, x.options().dtype(at::kFloat));
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const at::Half* dp = d.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, 64, [&](int64_t o0, int64_t o1) {
    int64_t r = 0;  // tiles of 8 rows share each block's conversion (the part bf16 dot products cannot hide)
    for (; r + 16 <= b; r += 16) rows_bf16<16, Q4>(xp + r * in, in, qp, dp, mp, yp + r * out, out, o0, o1);
    for (; r + 8 <= b; r += 8) rows_bf16<8, Q4>(xp + r * in, in, qp, dp, mp, yp + r * out, out, o0, o1);
    for (; r + 4 <= b; r += 4) rows_bf16<4, Q4>(xp + r * in, in, qp, dp, mp, yp + r * out, out, o0, o1);
    switch (b - r) {
      case 3: rows_bf16<3, Q4>(xp + r * in, in, qp, dp, mp, yp + r * out, out, o0, o1); break;
      case 2: rows_bf16<2, Q4>(xp + r * in, in, qp, dp, mp, yp + r * out, out, o0, o1); break;
      case 1: rows_bf16<1, Q4>(xp + r * in, in, qp, dp, mp, yp + r * out, out, o0, o1); break;
      default: break;
    }
  });
  return y;
}
#else
#define LOWBIT_BF16 0
#endif

// x bf16 [B, I] @ dequant(W)^T -> fp32 [B, O]: the bf16 path above where the CPU has it, else x in fp32
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be contiguous bf16 [B, I]");
#if LOWBIT_BF16
  TORCH_CHECK(x.size(1) % QK == 0, "in_features ", x.size(1), " is not a multiple of ", QK);
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.size(1) == x.size(1) / QK, "bad scales");
  TORCH_CHECK(qs.is_contiguous() && qs.size(1) == (m.has_value() ? x.size(1) / 2 : x.size(1)), "bad qs");
  if (m.has_value()) return lowbit_linear_bf16<true>(x, qs, d, m->data_ptr<at::Half>());
  return lowbit_linear_bf16<false>(x, qs, d, nullptr);
#else
  return m.has_value() ? q4_linear(x.to(at::kFloat), qs, d, *m) : q8_linear(x.to(at::kFloat), qs, d);
#endif
}

// x @ w^T for a dense weight as the engine's Linear computes it: an fp32 matrix through at::linear (F.linear's
// op), a bf16 one packed by oneDNN (torch.ops.mkldnn._reorder_linear_weight) through mkldnn::_linear_pointwise,
// the op the Python Linear calls, so both paths give the same numbers
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& w) {
  if (w.scalar_type() == at::kFloat) return at::linear(x, w);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, c10::IValue(), c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x @ W^T for low-bit planes (Q4_1 with m, Q8_0 without), a GGUF block format's bytes qs (fmt named, d undefined)
// or, d undefined and no fmt, a dense matrix qs
torch::Tensor linear_any(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                         const c10::optional<torch::Tensor>& m, const std::string& fmt) {
  if (!fmt.empty()) return blocks_linear(x, qs, fmt);
  if (!d.defined()) return dense_linear(x, qs);
  return m.has_value() ? q4_linear(x, qs, d, *m) : q8_linear(x, qs, d);
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

// One translation unit (a unity build): torch's headers are the bulk of a build, and three units compiled
// side by side by two builds took twice as long on 2 cores as one each. The sources stay apart for reading.
#include "lowbit_i8.cpp"  // NOLINT(bugprone-suspicious-include)
#include "layer_cpu.cpp"  // NOLINT(bugprone-suspicious-include)
#include "kquant_cpu.cpp"  // NOLINT(bugprone-suspicious-include)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // The kernels touch no Python object: they let go of the GIL while they compute (as torch's own ops do), so that
  // a server's event loop and other Python threads run beside an engine's step.
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("q4_linear", &q4_linear, release, "x [B, I] fp32 @ dequant(Q4_1 planes)^T -> [B, O] fp32");
  mod.def("q8_linear", &q8_linear, release, "x [B, I] fp32 @ dequant(Q8_0 planes)^T -> [B, O] fp32");
  mod.def("dequantize", &dequantize, release, "Q4_1 (with m) or Q8_0 planes -> fp32 [O, I]");
  mod.def("linear_add", &linear_add, release, "residual + x @ dequant(W)^T");
  mod.def("linear_bf16", &linear_bf16, release,
          "x bf16 [B, I] @ dequant(W)^T -> fp32 [B, O] (bf16 dot products where native)");
  mod.def("has_bf16", []() { return bool(LOWBIT_BF16); });
  mod.def("norm_linear", &norm_linear, release, "rms_norm(x) * norm_w @ dequant(W)^T");
  mod.def("decode_layer", &decode_layer, release, "a decoder layer for T new tokens per row (a step, a chain, a tree)");
  pybind11::class_<LayerForm>(mod, "LayerForm", pybind11::module_local())  // decode_layer's beyond Llama's
      .def(pybind11::init([](c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                             c10::optional<torch::Tensor> attn_out_norm, c10::optional<torch::Tensor> mlp_out_norm,
                             std::string act, int64_t window, std::vector<std::string> fmts) {
             return LayerForm{q_norm, k_norm, attn_out_norm, mlp_out_norm, act, window, fmts};
           }),
           pybind11::arg("q_norm") = pybind11::none(), pybind11::arg("k_norm") = pybind11::none(),
           pybind11::arg("attn_out_norm") = pybind11::none(), pybind11::arg("mlp_out_norm") = pybind11::none(),
           pybind11::arg("act") = "silu", pybind11::arg("window") = 0,
           pybind11::arg("fmts") = std::vector<std::string>());
  pybind11::class_<LayerStack>(mod, "LayerStack", pybind11::module_local())  // one per build (native, avx2)
      .def(pybind11::init([](std::vector<torch::Tensor> in_norms, std::vector<torch::Tensor> post_norms,
                             std::vector<std::vector<torch::Tensor>> qkv, std::vector<std::vector<torch::Tensor>> o,
                             std::vector<std::vector<torch::Tensor>> gate_up,
                             std::vector<std::vector<torch::Tensor>> down, double eps, int64_t heads,
                             int64_t kv_heads, double scale) {
             const size_t n = in_norms.size();
             TORCH_CHECK(post_norms.size() == n && qkv.size() == n && o.size() == n && gate_up.size() == n &&
                             down.size() == n, "one norm pair and four weights per layer");
             return LayerStack{in_norms, post_norms, qkv, o, gate_up, down, eps, scale, heads, kv_heads};
           }))
      .def("forward", &LayerStack::forward, release, "h [N T, D] through every layer (see decode_layer)");
  mod.def("mlp", &mlp, release, "h + down(silu(gate) * up), (gate, up) = gate_up(rms_norm(h) * norm_w)");
  mod.def("quantize_rows_i8", &quantize_rows_i8, release,
          "x fp32/bf16 [B, I] -> (qx int8 [B, I], dx fp32 [B, I/32], sx fp32 [B, I/32]): Q8_1 blocks, fp32 scales");
  mod.def("q4_linear_i8", &q4_linear_i8, release, "x [B, I] as int8 blocks @ dequant(Q4_1 planes)^T -> [B, O] fp32");
  mod.def("q8_linear_i8", &q8_linear_i8, release, "x [B, I] as int8 blocks @ dequant(Q8_0 planes)^T -> [B, O] fp32");
  mod.def("blocks_linear", &blocks_linear, release,
          "x [B, I] fp32 @ dequant(W)^T -> [B, O] fp32, W uint8 [O, bytes] in a GGUF block format (q4_k, q6_k, q5_0, ...)");
  mod.def("blocks_dequantize", &blocks_dequantize, release,
          "W uint8 [O, bytes] in a GGUF block format, in_features -> fp32 [O, I]");
  mod.def("simd_i8", []() { return std::string(simd_i8()); });
  mod.def(
      "grouped_attention",
      [](bool on) {
        const bool was = grouped_attention_on.exchange(on);
        return was && LOWBIT_AVX512;
      },
      "use attention's grouped AVX-512 path (default on); returns whether it was in use");
  mod.def("simd", []() {
    return std::string(LOWBIT_AVX512 ? "avx512" : LOWBIT_AVX2 ? "avx2+fma+f16c" : "scalar");
  });
}

