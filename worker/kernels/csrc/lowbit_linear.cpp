// y = x W^T for float32 activations and GGUF's own low-bit weights, exactly as stored:
//
//   Q4 (Q4_0 / Q4_1)  per block of 32 along K: w = d * q + m, q in 0..15 (Q4_0: m = -8d);
//                     16 bytes per block, low nibbles = values 0..15, high = 16..31
//   Q8 (Q8_0)         per block of 32: w = d * q, q int8
//
// stepserve_cpu::lowbit_linear(x [M, K] f32, codes, d [N, K/32] f32, m [N, K/32] f32 or
// empty, bits 4|8) -> [M, N] f32. The weights are never dequantized to memory: each
// block is widened to floats in registers, scaled, and multiplied into every row of x, so
// a step reads 4 or 8 bits per weight (the bytes that bound a decode step) and computes in
// float32 throughout (no bfloat16 rounding of inputs or outputs). Rows of W are split
// across threads; every output is one row's dot product summed in a fixed order, so a
// request's result does not depend on what else is in the batch. Where the CPU has
// AVX512-VNNI, worker.linear runs GGUF weights through csrc/int8_linear.cpp instead unless
// float32 activations are asked for (--gguf-activations float32).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SS_W 16
using vf = __m512;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vset(float x) { return _mm512_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
// 16 weights of a block as floats: unsigned nibbles (Q4) or signed bytes (Q8)
static inline vf widen_u8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
static inline vf widen_s8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SS_W 8
using vf = __m256;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vset(float x) { return _mm256_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
static inline vf widen_u8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
static inline vf widen_s8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
#endif

namespace {

constexpr int64_t kBlock = 32;
// Rows of x per pass, so that their accumulators stay in registers (16 ymm / 32 zmm).
#if defined(SS_W) && SS_W == 8
constexpr int64_t kMaxRows = 2;
#else
constexpr int64_t kMaxRows = 8;
#endif


#ifdef SS_W
// Rows [row, row + count) of W (codes, scales, mins) into the cache ahead of their use.
inline void prefetch_rows(const uint8_t* codes, const float* d, const float* m, int64_t row_bytes, int64_t groups,
                          int64_t row, int64_t count) {
  for (int64_t b = 0; b < count * row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(codes + row * row_bytes + b), _MM_HINT_T0);
  for (int64_t b = 0; b < count * groups; b += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(d + row * groups + b), _MM_HINT_T0);
    if (m) _mm_prefetch(reinterpret_cast<const char*>(m + row * groups + b), _MM_HINT_T0);
  }
}

// The 32 weights of block `g` of one row as 32 / SS_W float vectors.
template <int Bits>
inline void block_weights(const uint8_t* codes, float d, float m, vf* w) {
  if constexpr (Bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
#if SS_W == 16
    // the 16 values d * q + m as a table, indexed by each lane's nibble: one FMA per block
    // instead of a widen, a convert and an FMA per 16 weights
    (void)lo;
    (void)hi;
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_ps(d), _mm512_set1_ps(m));
    const __m512i bytes = _mm512_cvtepu8_epi32(packed);  // permutexvar reads the low 4 bits
    w[0] = _mm512_permutexvar_ps(bytes, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
#else
    const vf vd = vset(d), vm = vset(m);
    w[0] = vfma(widen_u8(lo), vd, vm);
    w[1] = vfma(widen_u8(_mm_srli_si128(lo, 8)), vd, vm);
    w[2] = vfma(widen_u8(hi), vd, vm);
    w[3] = vfma(widen_u8(_mm_srli_si128(hi, 8)), vd, vm);
#endif
  } else {
    (void)m;
    const vf vd = vset(d), zero = vzero();
    for (int64_t j = 0; j < kBlock / SS_W; ++j) {
      const auto* p = reinterpret_cast<const __m128i*>(codes + j * SS_W);
#if SS_W == 16
      w[j] = vfma(widen_s8(_mm_loadu_si128(p)), vd, zero);
#else
      w[j] = vfma(widen_s8(_mm_loadl_epi64(p)), vd, zero);
#endif
    }
  }
}

// Output rows [r0, r0 + rows) of W against `mrows` (<= kMaxRows / R) rows of x, R rows of W
// at a time: with few rows of x, two or four rows of W let each x vector feed them all and
// their FMA chains overlap; with many, one row of W keeps every row of x's accumulators in
// registers.
template <int Bits, int64_t R>
void rows_vec(const float* x, int64_t mrows, int64_t K, const uint8_t* codes, const float* d, const float* m,
              float* y, int64_t N, int64_t r0, int64_t rows) {
  const int64_t groups = K / kBlock, row_bytes = K * Bits / 8, block_bytes = kBlock * Bits / 8;
  constexpr int64_t V = kBlock / SS_W;
  constexpr int64_t kAhead = 4;  // rows of W prefetched ahead of the one being read
  for (int64_t n = r0; n < r0 + rows; n += R) {
    const int64_t nr = std::min(R, r0 + rows - n);
    if (n + kAhead * R < N) prefetch_rows(codes, d, m, row_bytes, groups, n + kAhead * R, R);
    vf acc[kMaxRows / R][R][V];
    for (int64_t i = 0; i < mrows; ++i)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < V; ++j) acc[i][r][j] = vzero();
    for (int64_t g = 0; g < groups; ++g) {
      vf w[R][V];
      for (int64_t r = 0; r < R; ++r) {
        const int64_t row = n + std::min(r, nr - 1);  // an odd last row is computed twice, stored once
        block_weights<Bits>(codes + row * row_bytes + g * block_bytes, d[row * groups + g],
                            m ? m[row * groups + g] : 0.f, w[r]);
      }
      for (int64_t i = 0; i < mrows; ++i) {
        const float* xg = x + i * K + g * kBlock;
        for (int64_t j = 0; j < V; ++j) {
          const vf xv = vload(xg + j * SS_W);
          for (int64_t r = 0; r < R; ++r) acc[i][r][j] = vfma(w[r][j], xv, acc[i][r][j]);
        }
      }
    }
    for (int64_t i = 0; i < mrows; ++i)
      for (int64_t r = 0; r < nr; ++r) {
        vf total = acc[i][r][0];
        for (int64_t j = 1; j < V; ++j) total = vadd(total, acc[i][r][j]);
        y[i * N + n + r] = vsum(total);
      }
  }
}
#endif

// The same without vector instructions (machines the build found no AVX2 / AVX-512 on).
template <int Bits>
void rows_scalar(const float* x, int64_t mrows, int64_t K, const uint8_t* codes, const float* d, const float* m,
                 float* y, int64_t N, int64_t r0, int64_t rows) {
  const int64_t groups = K / kBlock, row_bytes = K * Bits / 8, block_bytes = kBlock * Bits / 8;
  for (int64_t n = r0; n < r0 + rows; ++n) {
    const uint8_t* rc = codes + n * row_bytes;
    for (int64_t i = 0; i < mrows; ++i) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = rc + g * block_bytes;
        const float dg = d[n * groups + g], mg = m ? m[n * groups + g] : 0.f;
        const float* xg = x + i * K + g * kBlock;
        for (int64_t j = 0; j < kBlock; ++j) {
          float q;
          if constexpr (Bits == 4) {
            q = static_cast<float>(j < 16 ? (b[j] & 0x0F) : (b[j - 16] >> 4));
          } else {
            q = static_cast<float>(static_cast<int8_t>(b[j]));
          }
          acc += (dg * q + mg) * xg[j];
        }
      }
      y[i * N + n] = acc;
    }
  }
}


template <int Bits>
void run(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* d, const float* m, float* y,
         int64_t N) {
  constexpr int64_t kRowsPerTask = 16;
  at::parallel_for(0, (N + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kRowsPerTask, rows = std::min(kRowsPerTask, N - r0);
#ifdef SS_W
      if (M * 4 <= kMaxRows && SS_W == 16) {  // 1-2 tokens: four rows of W (measured 1.3x two)
        rows_vec<Bits, 4>(x, M, K, codes, d, m, y, N, r0, rows);
        continue;
      }
      if (M * 2 <= kMaxRows && SS_W == 16) {
        rows_vec<Bits, 2>(x, M, K, codes, d, m, y, N, r0, rows);
        continue;
      }
#endif
      for (int64_t i0 = 0; i0 < M; i0 += kMaxRows) {
        const int64_t mrows = std::min(kMaxRows, M - i0);
#ifdef SS_W
        rows_vec<Bits, 1>(x + i0 * K, mrows, K, codes, d, m, y + i0 * N, N, r0, rows);
#else
        rows_scalar<Bits>(x + i0 * K, mrows, K, codes, d, m, y + i0 * N, N, r0, rows);
#endif
      }
    }
  });
}

}  // namespace

at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                         int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0);
  TORCH_CHECK(K % kBlock == 0 && d.size(1) == K / kBlock, "K must be a multiple of 32 with one scale per block");
  TORCH_CHECK(codes.numel() == N * K * bits / 8, "codes hold ", codes.numel(), " bytes, expected ", N * K * bits / 8);
  const bool has_m = m.numel() > 0;
  TORCH_CHECK(!has_m || (m.sizes() == d.sizes() && bits == 4), "mins: Q4 only, shaped like the scales");
  auto xc = x.contiguous();
  auto dc = d.contiguous().to(at::kFloat);
  auto mc = has_m ? m.contiguous().to(at::kFloat) : m;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* mp = has_m ? mc.data_ptr<float>() : nullptr;
  if (bits == 4)
    run<4>(xc.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), dc.data_ptr<float>(), mp, y.data_ptr<float>(), N);
  else
    run<8>(xc.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), dc.data_ptr<float>(), mp, y.data_ptr<float>(), N);
  return y;
}


TORCH_LIBRARY_FRAGMENT(stepserve_cpu, m) {
  m.def("lowbit_linear(Tensor x, Tensor codes, Tensor d, Tensor m, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(stepserve_cpu, CPU, m) { m.impl("lowbit_linear", &lowbit_linear); }
