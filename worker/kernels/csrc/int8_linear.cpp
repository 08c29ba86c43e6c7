// y = x W^T for GGUF's low-bit weights (Q4_0 / Q4_1 / Q8_0) with integer dot products
// (AVX512-VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd where the CPU lacks VNNI), over the weights re-laid once at load in tiles of 16 output rows:
//
//   codes  [tiles, K/32, 256 | 512] uint8: per tile and block of 32 along K, 64-byte vectors
//          whose byte 4r + i (r: the tile's row, i: 0..3) holds weight 4p + i of the block
//          for row r. Q4: vector j (0..3) holds quad p = j in its low nibbles and p = j + 4 in
//          its high ones (code q, 0..15). Q8: vector p (0..7), the code q + 128.
//   d, m   [tiles, K/32, 16] float16: the scales (and Q4's offsets), w = d q + m
//          (Q8: w = d (c - 128) for its stored c).
//
// Each row of x is quantized per block of 32 in two levels (as llama.cpp's Q8 activations,
// plus a second byte for the residual): x = s (128 a + b) with s = amax / (127 * 128),
// a = round(x / (128 s)) in -127..127 and b the rounded residual, |b| <= 64, so each
// activation keeps ~15 bits of its block's range instead of llama.cpp's 8 (one level
// measured 96 % teacher-forced top-1 agreement with the float32 reference on the default
// model, two levels 99.9 %). For a block: sum_k c_k x_k = s (128 sum c a + sum c b), two
// chains of 8 vpdpbusd (64 multiply-adds each) in int32, exact, then one float FMA per
// block (two with Q4's offsets: m * s * sum(128 a + b)). Lanes are the tile's 16 rows, so
// no horizontal sums. A row's output depends on that row of x alone and is computed the
// same way whatever the batch (integer sums, then float operations in block order), so the
// product is bitwise batch-invariant.
//
// stepserve_cpu::int8_linear(x [M, K] f32, codes, d, m (Q8: empty), bits 4|8, n) -> [M, n]
// stepserve_cpu::int8_linear_supported() -> whether this build has the kernel (the CPU
// lists AVX512-VNNI, or AVX2 with FMA and F16C); worker.linear keeps GGUF's stored form
// elsewhere. Both paths compute the same integer sums and the same float operations in the
// same order, so their outputs are bitwise equal.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SS_INT8_LINEAR 1
#define SS_INT8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SS_INT8_LINEAR 1
#define SS_INT8_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32, kTile = 16;

#ifdef SS_INT8_LINEAR
// Blocks read ahead by software prefetch (8 KB of Q4 codes, 16 KB of Q8): the hardware's
// stream prefetch alone left a one-token step's products at ~30-36 GB/s of the 36-48 GB/s
// two cores stream; 32 blocks ahead measured 0.74-0.91x the time of none (8: 0.92x, 16: 0.82x,
// 48-96 no better; measured on AVX-512 CPUs, the AVX2 path uses the same), tiles being
// contiguous so the last blocks of one prefetch the next.
constexpr int64_t kAhead = 32;

// base + bytes into L1, computed as an integer: the address may lie past the array's end,
// which a prefetch never faults on (and pointer arithmetic there would be undefined)
inline void prefetch(const void* base, int64_t bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + bytes), _MM_HINT_T0);
}

// a tile's block g + kAhead (codes, scales, Q4's offsets) into L1
template <int Bits>
inline void prefetch_ahead(const uint8_t* c, const uint16_t* dt, const uint16_t* mt, int64_t g) {
  constexpr int64_t kBytes = Bits == 4 ? 256 : 512;
  for (int64_t o = 0; o < kBytes; o += 64) prefetch(c, (g + kAhead) * kBytes + o);
  prefetch(dt, (g + kAhead) * kTile * 2);
  if constexpr (Bits == 4) prefetch(mt, (g + kAhead) * kTile * 2);
}

struct Quantized {
  const int8_t* a;     // [M, K] high level
  const int8_t* b;     // [M, K] residual
  const float* s;      // [M, G] step of b
  const int32_t* sum;  // [M, G] sum over the block of 128 a + b
};
#endif

#if defined(SS_INT8_VNNI)
constexpr int kRows = 4;  // rows of x per pass over a tile's block (their 8 chains overlap)

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* a, int8_t* b, float* s, int32_t* sum) {
  const int64_t G = K / kBlock;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t i = begin; i < end; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = i * K + g * kBlock;
        const __m512 v[2] = {_mm512_loadu_ps(x + at), _mm512_loadu_ps(x + at + 16)};
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], magnitude), _mm512_and_ps(v[1], magnitude)));
        const float step = amax / 127.f;  // of a
        const __m512 inv = _mm512_set1_ps(step > 0.f ? 1.f / step : 0.f), vstep = _mm512_set1_ps(step);
        const __m512 inv_b = _mm512_mul_ps(inv, _mm512_set1_ps(128.f));
        __m512i total = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
          const __m512 ra = _mm512_roundscale_ps(_mm512_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT);
          const __m512i qa = _mm512_cvtps_epi32(ra);
          // the residual, exact in float32 (x - step * ra: one rounding of a small difference)
          const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_fnmadd_ps(ra, vstep, v[h]), inv_b));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(a + at + 16 * h), _mm512_cvtsepi32_epi8(qa));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(b + at + 16 * h), _mm512_cvtsepi32_epi8(qb));
          total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_slli_epi32(qa, 7), qb));
        }
        s[i * G + g] = step / 128.f;
        sum[i * G + g] = _mm512_reduce_add_epi32(total);
      }
  });
}

// Tile t (16 output rows) against rows [i0, i0 + R) of x.
template <int Bits, int R>
void tile_rows(const Quantized& x, int64_t K, const uint8_t* codes, const uint16_t* d, const uint16_t* m, float* y,
               int64_t ystride, int64_t t, int64_t i0) {
  const int64_t G = K / kBlock;
  constexpr int64_t kBytes = Bits == 4 ? 256 : 512;
  const uint8_t* c = codes + t * G * kBytes;
  const uint16_t* dt = d + t * G * kTile;
  const uint16_t* mt = Bits == 4 ? m + t * G * kTile : nullptr;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (i0 == 0) prefetch_ahead<Bits>(c, dt, mt, g);  // the first pass brings the tile in; later ones find it cached
    __m512i w[8];
    if constexpr (Bits == 4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(c + g * kBytes + 64 * j);
        w[j] = _mm512_and_si512(v, low);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(c + g * kBytes + 64 * j);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dt + g * kTile)));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (Bits == 4) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mt + g * kTile)));
    for (int i = 0; i < R; ++i) {
      const int64_t row = i0 + i, at = row * K + g * kBlock;
      const auto* qa = reinterpret_cast<const int32_t*>(x.a + at);
      const auto* qb = reinterpret_cast<const int32_t*>(x.b + at);
      const int32_t sum = x.sum[row * G + g];
      // Q8's codes are q + 128: start at -128 * sum(128 a + b)
      // two chains a level (even and odd vectors): four dependent vpdpbusd each, not eight
      __m512i hi0 = _mm512_setzero_si512(), hi1 = _mm512_setzero_si512();
      __m512i lo0 = _mm512_set1_epi32(Bits == 8 ? -128 * sum : 0), lo1 = _mm512_setzero_si512();
      for (int p = 0; p < 8; p += 2) {
        hi0 = _mm512_dpbusd_epi32(hi0, w[p], _mm512_set1_epi32(qa[p]));
        lo0 = _mm512_dpbusd_epi32(lo0, w[p], _mm512_set1_epi32(qb[p]));
        hi1 = _mm512_dpbusd_epi32(hi1, w[p + 1], _mm512_set1_epi32(qa[p + 1]));
        lo1 = _mm512_dpbusd_epi32(lo1, w[p + 1], _mm512_set1_epi32(qb[p + 1]));
      }
      const __m512i hi = _mm512_add_epi32(hi0, hi1), lo = _mm512_add_epi32(lo0, lo1);
      const float s = x.s[row * G + g];
      const __m512 total = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo));
      acc[i] = _mm512_fmadd_ps(total, _mm512_mul_ps(dw, _mm512_set1_ps(s)), acc[i]);
      if constexpr (Bits == 4) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(s * static_cast<float>(sum)), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + (i0 + i) * ystride + t * kTile, acc[i]);
}

template <int Bits>
void run(const Quantized& x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* d, const uint16_t* m,
         float* y, int64_t tiles) {
  const int64_t ystride = tiles * kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t i0 = 0;
      for (; i0 + kRows <= M; i0 += kRows) tile_rows<Bits, kRows>(x, K, codes, d, m, y, ystride, t, i0);
      static_assert(kRows == 4, "the tail below covers 1..3 rows");
      switch (M - i0) {
        case 1: tile_rows<Bits, 1>(x, K, codes, d, m, y, ystride, t, i0); break;
        case 2: tile_rows<Bits, 2>(x, K, codes, d, m, y, ystride, t, i0); break;
        case 3: tile_rows<Bits, 3>(x, K, codes, d, m, y, ystride, t, i0); break;
        default: break;
      }
    }
  });
}
#elif defined(SS_INT8_AVX2)
// AVX2 without VNNI: vpmaddubsw multiplies the unsigned weight bytes by the signed activation
// bytes and adds neighbouring pairs into int16, vpmaddwd(.., 1) then adds those pairs into the
// int32 lanes vpdpbusd would give. A 32-byte vector holds 8 of a tile's 16 rows, so a 64-byte
// vector of the layout is two halves, both read in the same pass over the tile. Q4's codes
// (0..15) times |a| <= 127, pairs summed: <= 3,810, so a block's 8 vectors add up in int16
// (<= 30,480) before one vpmaddwd. Q8's codes (q + 128, up to 255) would saturate vpmaddubsw,
// so they are split into nibbles, c = 16 h + l, each summed in int16 like Q4's.
constexpr int kRows = 2;  // rows of x per pass (accumulators: 16 ymm registers)
inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// 32 int32 (four vectors, in order) saturated to int8, in order
inline __m256i pack_bytes(__m256i q0, __m256i q1, __m256i q2, __m256i q3) {
  const __m256i words = _mm256_packs_epi32(q0, q1), words2 = _mm256_packs_epi32(q2, q3);
  // the packs work within 128-bit lanes: 4-byte groups come out as 0 2 4 6 1 3 5 7
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* a, int8_t* b, float* s, int32_t* sum) {
  const int64_t G = K / kBlock;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = i * K + g * kBlock;
        __m256 v[4];
        for (int h = 0; h < 4; ++h) v[h] = _mm256_loadu_ps(x + at + 8 * h);
        const float amax = hmax(_mm256_max_ps(_mm256_max_ps(abs_ps(v[0]), abs_ps(v[1])),
                                              _mm256_max_ps(abs_ps(v[2]), abs_ps(v[3]))));
        const float step = amax / 127.f;
        const __m256 inv = _mm256_set1_ps(step > 0.f ? 1.f / step : 0.f), vstep = _mm256_set1_ps(step);
        const __m256 inv_b = _mm256_mul_ps(inv, _mm256_set1_ps(128.f));
        __m256i qa[4], qb[4], total = _mm256_setzero_si256();
        for (int h = 0; h < 4; ++h) {
          const __m256 ra = _mm256_round_ps(_mm256_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          qa[h] = _mm256_cvtps_epi32(ra);
          qb[h] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_fnmadd_ps(ra, vstep, v[h]), inv_b));
          total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_slli_epi32(qa[h], 7), qb[h]));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + at), pack_bytes(qa[0], qa[1], qa[2], qa[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(b + at), pack_bytes(qb[0], qb[1], qb[2], qb[3]));
        s[i * G + g] = step / 128.f;
        sum[i * G + g] = hsum(total);
      }
  });
}

// sum over the block's 8 vectors of w_p times activation quad p, int16 pairs per row byte pair
// (no overflow: see above), then the int32 per row of the half
template <int Bits>
inline __m256i dots(const __m256i* w, const int32_t* q) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 4) {
    __m256i acc = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(q[0]));
    for (int p = 1; p < 8; ++p) acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(w[p], _mm256_set1_epi32(q[p])));
    return _mm256_madd_epi16(acc, ones);
  } else {  // w[p]: low nibbles, w[8 + p]: high ones
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int p = 0; p < 8; ++p) {
      const __m256i v = _mm256_set1_epi32(q[p]);
      lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[p], v));
      hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w[8 + p], v));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(16)), _mm256_madd_epi16(lo, ones));
  }
}

template <int Bits, int R>
void tile_rows(const Quantized& x, int64_t K, const uint8_t* codes, const uint16_t* d, const uint16_t* m, float* y,
               int64_t ystride, int64_t t, int64_t i0) {
  const int64_t G = K / kBlock;
  constexpr int64_t kBytes = Bits == 4 ? 256 : 512;
  const uint8_t* c = codes + t * G * kBytes;
  const uint16_t* dt = d + t * G * kTile;
  const uint16_t* mt = Bits == 4 ? m + t * G * kTile : nullptr;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (i0 == 0) prefetch_ahead<Bits>(c, dt, mt, g);
    for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7 of the tile
      __m256i w[Bits == 4 ? 8 : 16];
      if constexpr (Bits == 4) {
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + g * kBytes + 64 * j + 32 * h));
          w[j] = _mm256_and_si256(v, low);
          w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      } else {
        for (int p = 0; p < 8; ++p) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + g * kBytes + 64 * p + 32 * h));
          w[p] = _mm256_and_si256(v, low);
          w[8 + p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dt + g * kTile + 8 * h)));
      __m256 mw = _mm256_setzero_ps();
      if constexpr (Bits == 4) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mt + g * kTile + 8 * h)));
      for (int i = 0; i < R; ++i) {
        const int64_t row = i0 + i, at = row * K + g * kBlock;
        const int32_t sum = x.sum[row * G + g];
        const __m256i hi = dots<Bits>(w, reinterpret_cast<const int32_t*>(x.a + at));
        __m256i lo = dots<Bits>(w, reinterpret_cast<const int32_t*>(x.b + at));
        if constexpr (Bits == 8) lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(128 * sum));  // codes are q + 128
        const float s = x.s[row * G + g];
        const __m256 total = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(hi, 7), lo));
        acc[i][h] = _mm256_fmadd_ps(total, _mm256_mul_ps(dw, _mm256_set1_ps(s)), acc[i][h]);
        if constexpr (Bits == 4) acc[i][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(s * static_cast<float>(sum)), acc[i][h]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (i0 + i) * ystride + t * kTile + 8 * h, acc[i][h]);
}

template <int Bits>
void run(const Quantized& x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* d, const uint16_t* m,
         float* y, int64_t tiles) {
  const int64_t ystride = tiles * kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t i0 = 0;
      for (; i0 + kRows <= M; i0 += kRows) tile_rows<Bits, kRows>(x, K, codes, d, m, y, ystride, t, i0);
      static_assert(kRows == 2, "the tail below covers 1 row");
      if (i0 < M) tile_rows<Bits, 1>(x, K, codes, d, m, y, ystride, t, i0);
    }
  });
}
#endif

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                       int64_t bits, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [tiles, K/32, bytes]");
  const int64_t M = x.size(0), K = x.size(1), tiles = codes.size(0), G = codes.size(1);
  TORCH_CHECK(K == G * kBlock && codes.size(2) == (bits == 4 ? 256 : 512), "codes do not match x's K = ", K);
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == tiles * G * kTile, "d must be float16 [tiles, K/32, 16]");
  TORCH_CHECK(bits == 8 ? m.numel() == 0 : (m.scalar_type() == at::kHalf && m.is_contiguous() && m.numel() == d.numel()),
              "m: Q4's offsets, float16 shaped like d; empty for Q8");
  TORCH_CHECK(0 < n && n <= tiles * kTile, "n must be in 1..", tiles * kTile);
#ifdef SS_INT8_LINEAR
  auto xc = x.contiguous();
  auto y = at::empty({M, tiles * kTile}, x.options());
  if (M == 0) return y.narrow(1, 0, n);
  // the quantized activations, in buffers kept per calling thread (a step makes ~100 calls;
  // allocating four tensors each measured as much as a one-token product itself)
  thread_local std::vector<int8_t> a, b;
  thread_local std::vector<float> s;
  thread_local std::vector<int32_t> sum;
  a.resize(M * K);
  b.resize(M * K);
  s.resize(M * G);
  sum.resize(M * G);
  quantize_rows(xc.data_ptr<float>(), M, K, a.data(), b.data(), s.data(), sum.data());
  const Quantized q{a.data(), b.data(), s.data(), sum.data()};
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* mp = bits == 4 ? reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()) : nullptr;
  if (bits == 4)
    run<4>(q, M, K, codes.data_ptr<uint8_t>(), dp, mp, y.data_ptr<float>(), tiles);
  else
    run<8>(q, M, K, codes.data_ptr<uint8_t>(), dp, mp, y.data_ptr<float>(), tiles);
  return n == tiles * kTile ? y : y.narrow(1, 0, n).contiguous();
#else
  TORCH_CHECK(false, "int8_linear needs AVX512-VNNI or AVX2 + FMA + F16C, which this build does not have (int8_linear_supported())");
#endif
}

bool int8_linear_supported() {
#ifdef SS_INT8_LINEAR
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(stepserve_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor d, Tensor m, int bits, int n) -> Tensor");
  m.def("int8_linear_supported() -> bool", &int8_linear_supported);
}

TORCH_LIBRARY_IMPL(stepserve_cpu, CPU, m) { m.impl("int8_linear", &int8_linear); }
