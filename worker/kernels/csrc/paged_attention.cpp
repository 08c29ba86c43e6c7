// Paged attention on the CPU, reading the KV cache in place (no gathered copy per layer).
//
// One op per layer, stepserve_cpu::paged_attention(q, k, v, layer) -> out [T, H, D]:
//   1. write this step's K/V [T, KVH, D] into the layer's cache at slot_mapping;
//   2. every query token of a request with at most `small_query` tokens (decodes, short
//      chunks) attends to the first (position + 1) keys of its request, read block by block
//      through the block table: one work item per (token, span of kSpan keys) for all its
//      heads, in parallel, the spans' partial results merged after;
//   3. the longer chunks of float32 queries of head size 64 or 128 attend in place too:
//      one work item per (request, kv head, 32 query tokens), flash attention over 32-key
//      tiles with the query rows in vector lanes (attend_chunks; 1.6-2.8x faster than SDPA
//      at 128-1,024 tokens, bench/RESULTS.md), its two products as AVX512-BF16 dot products
//      where bind_step asks and the build has them; any other chunk runs torch's SDPA over
//      the fresh K/V when nothing was cached before it, else over its blocks gathered once.
//
// The cache tensors and the step's metadata live in this file's registry (set_kv_cache,
// bind_step), not in the op's arguments: a compiled forward then sees an op without
// mutated inputs (nothing for the compiler to functionalize or guard) and changing
// metadata never recompiles it. Caches: [num_blocks, block_size, kv_heads, row], contiguous:
// float32, bfloat16 or float16 rows of head_dim values, or int8 rows of head_dim values and
// then their float32 scale in 4 bytes (value = int8 * scale, scale = max |x| / 127 per token
// and kv head; worker/attention/kv_rows.py is the same format in torch).

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

struct StepState {
  std::vector<at::Tensor> k_caches, v_caches;
  at::Tensor slot_mapping;     // [T] int64
  at::Tensor query_start_loc;  // [B + 1] int64 (host)
  at::Tensor seq_lens;         // [B] int64 (host)
  at::Tensor block_tables;     // [B, max_blocks] int64 (host)
  int64_t small_query = 16;
  bool chunk_kernel = true;  // long chunks through attend_chunks (else SDPA)
  bool chunk_bf16 = false;   // attend_chunks' products in bfloat16 (bind_step; where the build has them)
};

StepState g_state;

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

// An int8 cache row's scale follows its D values; other element types have none.
template <typename C>
constexpr int64_t kScaleBytes = std::is_same_v<C, int8_t> ? 4 : 0;
template <typename C, int64_t D>
constexpr int64_t kRow = D + kScaleBytes<C>;  // a cache row's elements

template <typename C>
inline float row_scale(const C* row, int64_t d) {
  if constexpr (kScaleBytes<C> != 0) {
    float s;
    std::memcpy(&s, row + d, sizeof s);
    return s;
  } else {
    return 1.f;
  }
}

// One K or V row of D values as D / kW float vectors, converted on the fly (an int8 row's
// values unscaled: the callers fold its scale into a score or a weight).
template <int64_t D>
inline void load_row(const float* src, Vec* out) {
  for (int64_t j = 0; j < D / kW; ++j) out[j] = Vec::loadu(src + j * kW);
}
// bfloat16 and float16 rows: 2 * kW values a load, widened to float32.
template <int64_t D, typename H>
inline void load_half_row(const H* src, Vec* out) {
  using HVec = at::vec::Vectorized<H>;  // 2 * kW values
  for (int64_t j = 0; j < D / kW; j += 2) {
    auto [lo, hi] = at::vec::convert_to_float<H>(HVec::loadu(src + j * kW));
    out[j] = lo;
    out[j + 1] = hi;
  }
}
template <int64_t D>
inline void load_row(const at::BFloat16* src, Vec* out) {
  load_half_row<D>(src, out);
}
template <int64_t D>
inline void load_row(const at::Half* src, Vec* out) {
  load_half_row<D>(src, out);
}
template <int64_t D>
inline void load_row(const int8_t* src, Vec* out) {
  for (int64_t j = 0; j < D / kW; ++j) {
#if defined(CPU_CAPABILITY_AVX512)
    out[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j * kW))));
#elif defined(CPU_CAPABILITY_AVX2)
    out[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j * kW))));
#else
    float buf[kW];
    for (int64_t i = 0; i < kW; ++i) buf[i] = static_cast<float>(src[j * kW + i]);
    out[j] = Vec::loadu(buf);
#endif
  }
}
// The row's values themselves (an int8 row's times its scale).
template <typename C, int64_t D>
inline void load_scaled_row(const C* src, Vec* out) {
  load_row<D>(src, out);
  if constexpr (kScaleBytes<C> != 0) {
    const Vec s(row_scale(src, D));
    for (int64_t j = 0; j < D / kW; ++j) out[j] = out[j] * s;
  }
}

inline float reduce(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// Positions one work item covers (a multiple of the block size): a query token's context is
// cut into spans of this many keys, each attended on its own and the partial results merged
// (flash-decoding). Spans depend on the context length alone, never on the batch, so a
// token's output is the same in any batch; they also let one long decode use every thread.
constexpr int64_t kSpan = 256;

// Per-thread buffers, grown once.
struct Scratch {
  std::vector<float> scores;  // [heads, span]
  std::vector<float> query;   // [heads, D], scaled, float32
};

// One span's partial attention for every head: its max score, sum of exponentials and
// unnormalized weighted sum of V, to be merged with the token's other spans.
struct Partial {
  float* m;    // [heads]
  float* l;    // [heads]
  float* acc;  // [heads, D]
};

// Most query heads one pass keeps in registers: G * D / kW accumulators plus a row must fit
// in the vector registers (32 with AVX-512, 16 below).
template <int64_t D>
constexpr int64_t max_group() {
  constexpr int64_t regs = kW >= 16 ? 32 : 16, v = D / kW;
  return std::max<int64_t>(1, std::min<int64_t>(8, (regs / 2) / v));
}

// r[p] = the sum of acc[p]'s lanes, for the kW vectors acc[0..kW): a transposing tree of
// shuffles and adds (2 operations a row where reducing each vector costs 2 * log2(kW) + 1).
inline Vec sum_rows(Vec* acc) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)  // quarters: row 2i's halves summed, then row 2i + 1's
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter j: 4 partial sums of row 4i + j
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
  // lane 4j + k holds row 4k + j
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xEE));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 s[4], u[2];
  for (int i = 0; i < 4; ++i)  // halves: row 2i's, then row 2i + 1's 4 partial sums
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * i], acc[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(acc[2 * i], acc[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm256_add_ps(_mm256_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm256_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  // lane 4h + k holds row 2k + h
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x44), _mm256_shuffle_ps(u[0], u[1], 0xEE));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
  float buf[kW];
  for (int64_t p = 0; p < kW; ++p) buf[p] = reduce(acc[p]);
  return Vec::loadu(buf);
#endif
}

// Scores of one query head (qs: [D], scaled) against n keys (`k`, rows `stride` apart): kW
// rows at a time through sum_rows, the last n % kW one by one.
template <typename C, int64_t D>
inline void score_block(const float* qs, const C* k, int64_t stride, int64_t n, float* sc) {
  constexpr int64_t V = D / kW;
  Vec qv[V], row[V], acc[kW];
  for (int64_t j = 0; j < V; ++j) qv[j] = Vec::loadu(qs + j * kW);
  auto dot = [&](int64_t p) {
    load_row<D>(k + p * stride, row);
    Vec a = qv[0] * row[0];
    for (int64_t j = 1; j < V; ++j) a = at::vec::fmadd(qv[j], row[j], a);
    return a;
  };
  int64_t p0 = 0;
  for (; p0 + kW <= n; p0 += kW) {
    for (int64_t p = 0; p < kW; ++p) acc[p] = dot(p0 + p);
    if constexpr (kScaleBytes<C> != 0) {
      float scales[kW];
      for (int64_t p = 0; p < kW; ++p) scales[p] = row_scale(k + (p0 + p) * stride, D);
      (sum_rows(acc) * Vec::loadu(scales)).store(sc + p0);
    } else {
      sum_rows(acc).store(sc + p0);
    }
  }
  for (; p0 < n; ++p0) sc[p0] = reduce(dot(p0)) * row_scale(k + p0 * stride, D);
}

// acc[g] += sum over the n rows at `v` of w[g][p] * row p, for G heads at once.
template <typename C, int64_t D, int64_t G>
inline void weigh_rows(const float* w, int64_t ld, const C* v, int64_t stride, int64_t n, float* acc) {
  constexpr int64_t V = D / kW;
  Vec a[G][V], row[V];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < V; ++j) a[g][j] = Vec::loadu(acc + g * D + j * kW);
  for (int64_t p = 0; p < n; ++p) {
    load_row<D>(v + p * stride, row);
    const float scale = row_scale(v + p * stride, D);
    for (int64_t g = 0; g < G; ++g) {
      const Vec wg(w[g * ld + p] * scale);
      for (int64_t j = 0; j < V; ++j) a[g][j] = at::vec::fmadd(wg, row[j], a[g][j]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < V; ++j) a[g][j].store(acc + g * D + j * kW);
}

// Calls f(std::integral_constant<int64_t, G>{}, first head) over the `group` heads of one kv
// head in register-sized passes.
template <int64_t D, typename F>
inline void by_passes(int64_t group, F&& f) {
  constexpr int64_t most = max_group<D>();
  for (int64_t g0 = 0; g0 < group;) {
    const int64_t n = std::min(most, group - g0);
    switch (n) {
#define STEPSERVE_PASS(N) \
  case N:                 \
    if constexpr (N <= most) f(std::integral_constant<int64_t, N>{}, g0); \
    break;
      STEPSERVE_PASS(1) STEPSERVE_PASS(2) STEPSERVE_PASS(3) STEPSERVE_PASS(4)
      STEPSERVE_PASS(5) STEPSERVE_PASS(6) STEPSERVE_PASS(7) STEPSERVE_PASS(8)
#undef STEPSERVE_PASS
      default: break;  // unreachable: max_group is at most 8
    }
    g0 += n;
  }
}

// Reads one byte of every cache line of [p, p + elems), in order, before the heads read the
// block: a run of sequential misses is what the hardware prefetcher follows, where each
// head's rows alone (D values every kv_heads * D) measured 10-30 % slower. A software
// prefetch of the next block measured no gain.
template <typename C>
inline void touch_block(const C* p, int64_t elems) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(p);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(C));
  unsigned sink = 0;
  for (int64_t off = 0; off < bytes; off += 64) sink += b[off];
  asm volatile("" : : "r"(sink));
}

// Keys [p0, p1) of one query token (its block table `table`) for every head, block by block:
// a block's rows of all kv heads are contiguous, so it comes from memory as one run and every
// head then reads it from L1. One kv head at a time over the whole context (this kernel's
// previous form: each pass strides through the blocks, D values in every kv_heads * D)
// measured 1.2x slower with a float32 cache and 1.5x with a 16-bit one (bench/RESULTS.md).
template <typename C, int64_t D>
void attend_span(const float* qs, const C* k_cache, const C* v_cache, const int64_t* table, int64_t p0, int64_t p1,
                 int64_t heads, int64_t kv_heads, int64_t h0, int64_t h1, int64_t bs, Partial part, Scratch& s) {
  const int64_t group = heads / kv_heads, n = p1 - p0;
  const int64_t token_stride = kv_heads * kRow<C, D>, block_stride = bs * token_stride;
  const bool whole = h0 == 0 && h1 == kv_heads;  // else another item reads the other heads' rows
  s.scores.resize(heads * n);
  float* sc = s.scores.data();
  for (int64_t b0 = p0; b0 < p1; b0 += bs) {
    const C* block = k_cache + table[b0 / bs] * block_stride;
    const int64_t rows = std::min(bs, p1 - b0);
    if (whole) touch_block(block, rows * token_stride);
    for (int64_t i = h0 * group; i < h1 * group; ++i)
      score_block<C, D>(qs + i * D, block + (i / group) * kRow<C, D>, token_stride, rows, sc + i * n + (b0 - p0));
  }
  for (int64_t i = h0 * group; i < h1 * group; ++i) {
    float* si = sc + i * n;
    Vec vmax(-std::numeric_limits<float>::infinity());
    int64_t q = 0;
    for (; q + kW <= n; q += kW) vmax = at::vec::maximum(vmax, Vec::loadu(si + q));
    float mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax);
    for (; q < n; ++q) mx = std::max(mx, si[q]);
    part.m[i] = mx;
    const Vec vm(mx);
    Vec vsum(0.f);
    int64_t p = 0;
    for (; p + kW <= n; p += kW) {
      Vec e = (Vec::loadu(si + p) - vm).exp();
      e.store(si + p);
      vsum = vsum + e;
    }
    float sum = reduce(vsum);
    for (; p < n; ++p) {
      si[p] = std::exp(si[p] - part.m[i]);
      sum += si[p];
    }
    part.l[i] = sum;
  }
  std::fill(part.acc + h0 * group * D, part.acc + h1 * group * D, 0.f);
  for (int64_t b0 = p0; b0 < p1; b0 += bs) {
    const C* block = v_cache + table[b0 / bs] * block_stride;
    const int64_t rows = std::min(bs, p1 - b0);
    if (whole) touch_block(block, rows * token_stride);
    for (int64_t h = h0; h < h1; ++h)
      by_passes<D>(group, [&](auto G, int64_t g0) {
        const int64_t first = h * group + g0;
        weigh_rows<C, D, G()>(sc + first * n + (b0 - p0), n, block + h * kRow<C, D>, token_stride, rows, part.acc + first * D);
      });
  }
}

// Any other head size (or a block size that does not divide kSpan): one (token, kv head) at a
// time over the whole context, plain loops.
template <typename C, typename Q>
void attend_token_any(const Q* q, Q* out, const C* k_cache, const C* v_cache, const int64_t* table, int64_t L,
                      int64_t h, int64_t group, int64_t kv_heads, int64_t d, int64_t bs, float scale,
                      std::vector<float>& scores) {
  scores.resize(L);
  float* sc = scores.data();
  const int64_t row = d + kScaleBytes<C>, token_stride = kv_heads * row, block_stride = bs * token_stride;
  auto at_pos = [&](const C* cache, int64_t pos) {
    return cache + table[pos / bs] * block_stride + (pos % bs) * token_stride + h * row;
  };
  for (int64_t g = 0; g < group; ++g) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t pos = 0; pos < L; ++pos) {
      const C* kp = at_pos(k_cache, pos);
      float dot = 0.f;
      for (int64_t i = 0; i < d; ++i) dot += static_cast<float>(q[g * d + i]) * static_cast<float>(kp[i]);
      sc[pos] = dot * row_scale(kp, d) * scale;
      m = std::max(m, sc[pos]);
    }
    float sum = 0.f;
    for (int64_t p = 0; p < L; ++p) sum += (sc[p] = std::exp(sc[p] - m));
    for (int64_t i = 0; i < d; ++i) {
      float acc = 0.f;
      for (int64_t pos = 0; pos < L; ++pos) {
        const C* vp = at_pos(v_cache, pos);
        acc += sc[pos] * row_scale(vp, d) * static_cast<float>(vp[i]);
      }
      out[g * d + i] = static_cast<Q>(acc / sum);
    }
  }
}

// Every query token of the short requests: one work item per (token, span of kSpan keys),
// in parallel (per kv head too when there are too few to keep every thread busy: one
// decode); then each token's spans merged in order. How the work is cut never changes what
// a head computes.
template <typename C, typename Q, int64_t D>
void attend_spans(const at::Tensor& q, at::Tensor& out, const at::Tensor& kc, const at::Tensor& vc,
                  const std::vector<int64_t>& tokens, const std::vector<int64_t>& token_req,
                  const std::vector<int64_t>& token_len, float scale) {
  const int64_t heads = q.size(1), kv_heads = kc.size(2), bs = kc.size(1), n = static_cast<int64_t>(tokens.size());
  TORCH_CHECK(kSpan % bs == 0, "block size must divide ", kSpan);
  const auto* tables = g_state.block_tables.data_ptr<int64_t>();
  const int64_t table_width = g_state.block_tables.size(1);
  // kept across calls (a decode step makes one call a layer; their allocations showed)
  // (references: inside the parallel loop's lambda a thread_local name is the running thread's own)
  thread_local std::vector<int64_t> first_item_buf, item_token_buf;
  thread_local std::vector<float> partials_buf;
  auto& first_item = first_item_buf;  // token i's spans: items [first_item[i], first_item[i + 1])
  auto& item_token = item_token_buf;
  auto& partials = partials_buf;
  first_item.assign(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) first_item[i + 1] = first_item[i] + (token_len[i] + kSpan - 1) / kSpan;
  const int64_t items = first_item[n], per_item = heads * (D + 2);
  partials.resize(items * per_item);  // every element is written before it is read
  item_token.resize(items);
  for (int64_t i = 0; i < n; ++i) std::fill(item_token.begin() + first_item[i], item_token.begin() + first_item[i + 1], i);
  const C* k_ptr = kc.data_ptr<C>();
  const C* v_ptr = vc.data_ptr<C>();
  const Q* q_ptr = q.data_ptr<Q>();
  Q* o_ptr = out.data_ptr<Q>();
  auto part_of = [&](int64_t item) {
    float* base = partials.data() + item * per_item;
    return Partial{base, base + heads, base + 2 * heads};
  };
  const int64_t split = items < 2 * at::get_num_threads() ? kv_heads : 1;
  at::parallel_for(0, items * split, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t item = work / split, h0 = (work % split) * (kv_heads / split), h1 = h0 + kv_heads / split;
      const int64_t i = item_token[item], p0 = (item - first_item[i]) * kSpan;
      const int64_t p1 = std::min(token_len[i], p0 + kSpan);
      scratch.query.resize(heads * D);
      const Q* qt = q_ptr + tokens[i] * heads * D;
      for (int64_t x = 0; x < heads * D; ++x) scratch.query[x] = static_cast<float>(qt[x]) * scale;
      attend_span<C, D>(scratch.query.data(), k_ptr, v_ptr, tables + token_req[i] * table_width, p0, p1, heads,
                        kv_heads, h0, h1, bs, part_of(item), scratch);
    }
  });
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      Q* ot = o_ptr + tokens[i] * heads * D;
      const int64_t a = first_item[i], b = first_item[i + 1];
      for (int64_t hd = 0; hd < heads; ++hd) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t it = a; it < b; ++it) m = std::max(m, part_of(it).m[hd]);
        float l = 0.f, o[D] = {};
        for (int64_t it = a; it < b; ++it) {
          const Partial p = part_of(it);
          const float w = std::exp(p.m[hd] - m);  // 1 exactly for the span holding the max
          l += w * p.l[hd];
          for (int64_t x = 0; x < D; ++x) o[x] += w * p.acc[hd * D + x];
        }
        for (int64_t x = 0; x < D; ++x) ot[hd * D + x] = static_cast<Q>(o[x] / l);
      }
    }
  });
}

// ---- Long chunks (prefill): flash attention over the paged cache, query rows in lanes ----
//
// One work item per (request, kv head, kChunkTokens query tokens): the item's rows are
// those tokens for each of the kv head's query heads (row = head-in-group * kChunkTokens +
// token), held transposed, [D][rows], so a vector spans rows: the scores of a key tile are
// FMAs of a broadcast key element into row vectors (no horizontal sums), the online
// softmax (running max, rescale, sum) is elementwise across rows, and P V is FMAs of a
// broadcast value element into row vectors. Keys come from the cache through the block
// table, tile by tile (this chunk's own K/V were written first), converted to float32 once
// a tile and shared by every row of the item (the bf16 path: converted to bfloat16 once a
// step for all the request's items, Bf16Rows); tiles past the item's last position are
// skipped, and a tile crossing the diagonal masks keys past each row's position.
constexpr int64_t kChunkTokens = 32;  // a multiple of 2 * kW: a register block is one head's tokens
constexpr int64_t kKeyTile = 32;
constexpr int64_t kPass = kW >= 16 ? 8 : 4;  // keys (QK) or head elements (PV) per register pass

struct ChunkScratch {
  std::vector<float> qt, acc;  // [D][rows]: scaled queries, unnormalized outputs
  std::vector<float> m, l;     // [rows]: running max and sum of exponentials
  std::vector<float> k, v;     // [kKeyTile][D]: the tile's keys and values in float32 (float32 path)
  std::vector<float> p;        // [kKeyTile][2 kW]: one register block's scores, then weights
  // the bfloat16 products' operands, two bfloat16 a 32-bit word (low: the first):
  std::vector<uint32_t> qt2;   // [D / 2][rows]: a row's query elements (2e, 2e + 1)
  std::vector<uint32_t> p2;    // [kKeyTile / 2][2 kW]: a row's weights of keys (2i, 2i + 1)
};

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
// Long chunks may take their two products (Q K^T and P V) as AVX512-BF16 dot products:
// vdpbf16ps multiplies pairs of bfloat16 exactly and adds them into float32 lanes, twice the
// multiply-adds of a float32 FMA an instruction. The queries, keys, values and softmax
// weights are rounded to bfloat16 (as the wide steps' bf16 weight copy rounds the
// activations); scores, the online softmax and the sums stay float32.
#define SS_CHUNK_BF16 1
constexpr bool kChunkBf16 = true;

inline uint32_t bf16_bits(float x) { return c10::BFloat16(x).x; }

// two float vectors' lanes as bfloat16 pairs: lane i = (a[i], b[i])
inline __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// e^x for the softmax weights the bfloat16 path rounds to 8 bits: 2^(x log2 e) as 2^n times a
// degree-5 polynomial of the fraction in [-0.5, 0.5]: relative error below 6e-6 over
// [-87, 0] (measured against double's exp), far below the 2^-9 of the bfloat16 each weight
// is rounded to, in 10 operations where torch's exp_u20 takes about twice as many (the
// chunk kernel 0.92-0.93x the time over four 1,000-token prompts); exactly 0 below -87
// (masked keys are -inf), where e^x would leave float32's normal range anyway.
inline __m512 exp_bf16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022651f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

inline __m512 dot_bf16(__m512 acc, __m512i pairs, uint32_t broadcast) {
  return _mm512_dpbf16_ps(acc, (__m512bh)pairs, (__m512bh)_mm512_set1_epi32(static_cast<int>(broadcast)));
}
#else
constexpr bool kChunkBf16 = false;
#endif

struct ChunkItem {
  int64_t req, chunk;     // request index, and its place in the batch's chunks
  int64_t head, t0;       // kv head, first query token within its chunk
  int64_t cost;           // keys x rows, to hand out the largest items first
};

// Where token p's row of kv head h starts in a paged cache (elements from its start).
template <typename C, int64_t D>
inline int64_t row_offset(const int64_t* table, int64_t p, int64_t h, int64_t kv_heads, int64_t bs) {
  const int64_t token_stride = kv_heads * kRow<C, D>;
  return table[p / bs] * bs * token_stride + (p % bs) * token_stride + h * kRow<C, D>;
}

// Keys a request's converted rows hold: its context, padded to whole key tiles.
inline int64_t padded_keys(int64_t len) { return (len + kKeyTile - 1) / kKeyTile * kKeyTile; }

// A request's keys and values of one kv head in bfloat16, as the bf16 products read them:
// k2 [keys][D / 2] (a key's elements 2e, 2e + 1 in one word), v2 [keys / 2][D] (element d of
// keys 2i, 2i + 1), keys padded with zeros to whole key tiles. Converted once a step for every
// item that reads them (convert_tile), where each item converting its own tiles measured
// ~10 % of the kernel's time.
struct Bf16Rows {
  const uint32_t* k2 = nullptr;
  const uint32_t* v2 = nullptr;
};

template <typename C, int64_t D, bool Bf16>
void attend_chunk_item(const float* q, float* out, const C* k_cache, const C* v_cache, const int64_t* table,
                       int64_t row0, int64_t nt, int64_t pos0, int64_t h, int64_t group, int64_t heads,
                       int64_t kv_heads, int64_t bs, float scale, const Bf16Rows& converted, ChunkScratch& s) {
  constexpr int64_t T = kChunkTokens, RB = 2 * kW;
  static_assert(T % RB == 0 && kKeyTile % kPass == 0 && D % kPass == 0, "tiles must divide evenly");
  static_assert(!Bf16 || (kChunkBf16 && kKeyTile % 2 == 0), "bfloat16 products need AVX512-BF16");
  const int64_t R = group * T, last = pos0 + nt - 1;  // row token i sits at position pos0 + i
  s.acc.assign(D * R, 0.f);
  s.m.assign(R, -std::numeric_limits<float>::infinity());
  s.l.assign(R, 0.f);
  s.p.resize(kKeyTile * RB);
  // rows of padding tokens (nt < T) stay zero and are never written out
  if constexpr (Bf16) {
    s.qt2.assign(D / 2 * R, 0u);
    s.p2.resize(kKeyTile / 2 * RB);
  } else {
    s.k.resize(kKeyTile * D);
    s.v.resize(kKeyTile * D);
    s.qt.assign(D * R, 0.f);
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < nt; ++i) {
      const float* src = q + (row0 + i) * heads * D + (h * group + g) * D;
      if constexpr (Bf16) {
#ifdef SS_CHUNK_BF16
        for (int64_t e = 0; e < D / 2; ++e)
          s.qt2[e * R + g * T + i] = bf16_bits(src[2 * e] * scale) | bf16_bits(src[2 * e + 1] * scale) << 16;
#endif
      } else {
        for (int64_t d = 0; d < D; ++d) s.qt[d * R + g * T + i] = src[d] * scale;
      }
    }
  float* kt = s.k.data();
  float* vt = s.v.data();
  float* pt = s.p.data();
  Vec rows[D / kW];
  for (int64_t k0 = 0; k0 <= last; k0 += kKeyTile) {
    const int64_t kn = std::min(kKeyTile, last + 1 - k0);
    const uint32_t* k2 = Bf16 ? converted.k2 + k0 * D / 2 : nullptr;  // the bf16 path's tile (Bf16Rows)
    const uint32_t* v2 = Bf16 ? converted.v2 + k0 / 2 * D : nullptr;
    if constexpr (!Bf16) {
      for (int64_t j = 0; j < kn; ++j) {
        const int64_t off = row_offset<C, D>(table, k0 + j, h, kv_heads, bs);
        load_scaled_row<C, D>(k_cache + off, rows);
        for (int64_t x = 0; x < D / kW; ++x) rows[x].store(kt + j * D + x * kW);
        load_scaled_row<C, D>(v_cache + off, rows);
        for (int64_t x = 0; x < D / kW; ++x) rows[x].store(vt + j * D + x * kW);
      }
      std::fill(kt + kn * D, kt + kKeyTile * D, 0.f);  // masked below; zeros keep 0 * value finite
      std::fill(vt + kn * D, vt + kKeyTile * D, 0.f);
    }
    const bool diagonal = k0 + kKeyTile - 1 > pos0;  // some key of the tile is past some row
    for (int64_t rb = 0; rb < R; rb += RB) {
      for (int64_t j0 = 0; j0 < kKeyTile; j0 += kPass) {  // scores: p[j][lane] = q[lane] . k[j]
        Vec a[kPass][2];
        for (int64_t jj = 0; jj < kPass; ++jj) a[jj][0] = a[jj][1] = Vec(0.f);
        if constexpr (Bf16) {
#ifdef SS_CHUNK_BF16
          const uint32_t* qb = s.qt2.data() + rb;
          for (int64_t e = 0; e < D / 2; ++e) {
            const __m512i q0 = _mm512_loadu_si512(qb + e * R), q1 = _mm512_loadu_si512(qb + e * R + kW);
            for (int64_t jj = 0; jj < kPass; ++jj) {
              const uint32_t kv = k2[(j0 + jj) * D / 2 + e];
              a[jj][0] = dot_bf16(a[jj][0], q0, kv);
              a[jj][1] = dot_bf16(a[jj][1], q1, kv);
            }
          }
#endif
        } else {
          const float* qb = s.qt.data() + rb;
          for (int64_t d = 0; d < D; ++d) {
            const Vec q0 = Vec::loadu(qb + d * R), q1 = Vec::loadu(qb + d * R + kW);
            for (int64_t jj = 0; jj < kPass; ++jj) {
              const Vec kv(kt[(j0 + jj) * D + d]);
              a[jj][0] = at::vec::fmadd(q0, kv, a[jj][0]);
              a[jj][1] = at::vec::fmadd(q1, kv, a[jj][1]);
            }
          }
        }
        for (int64_t jj = 0; jj < kPass; ++jj) {
          a[jj][0].store(pt + (j0 + jj) * RB);
          a[jj][1].store(pt + (j0 + jj) * RB + kW);
        }
      }
      Vec pos[2], mx[2], sum[2] = {Vec(0.f), Vec(0.f)};
      for (int64_t x = 0; x < 2; ++x) {
        float lane[kW];
        for (int64_t i = 0; i < kW; ++i)  // padding tokens take the last real one's position
          lane[i] = static_cast<float>(pos0 + std::min((rb + x * kW + i) % T, nt - 1));
        pos[x] = Vec::loadu(lane);
        mx[x] = Vec::loadu(s.m.data() + rb + x * kW);
      }
      const Vec neg_inf(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < kKeyTile; ++j)
        for (int64_t x = 0; x < 2; ++x) {
          Vec sc = Vec::loadu(pt + j * RB + x * kW);
          if (diagonal) sc = Vec::blendv(sc, neg_inf, pos[x] < Vec(static_cast<float>(k0 + j)));
          sc.store(pt + j * RB + x * kW);
          mx[x] = at::vec::maximum(mx[x], sc);
        }
      // the bfloat16 path rounds the weights to 8 bits: exp_bf16 (error below 6e-6) suffices
      const auto exp = [](const Vec& v) -> Vec {
#ifdef SS_CHUNK_BF16
        if constexpr (Bf16) return Vec(exp_bf16(v));
#endif
        return v.exp();
      };
      Vec alpha[2];
      for (int64_t x = 0; x < 2; ++x) {
        alpha[x] = exp(Vec::loadu(s.m.data() + rb + x * kW) - mx[x]);  // 0 on the first tile
        mx[x].store(s.m.data() + rb + x * kW);
      }
      for (int64_t j = 0; j < kKeyTile; ++j)
        for (int64_t x = 0; x < 2; ++x) {
          const Vec e = exp(Vec::loadu(pt + j * RB + x * kW) - mx[x]);
          e.store(pt + j * RB + x * kW);
          sum[x] = sum[x] + e;
        }
      for (int64_t x = 0; x < 2; ++x)
        at::vec::fmadd(Vec::loadu(s.l.data() + rb + x * kW), alpha[x], sum[x]).store(s.l.data() + rb + x * kW);
      float* ab = s.acc.data() + rb;
#ifdef SS_CHUNK_BF16
      if constexpr (Bf16)  // the weights of keys (2i, 2i + 1) paired per row; past kn they are 0
        for (int64_t i = 0; i < (kn + 1) / 2; ++i)
          for (int64_t x = 0; x < 2; ++x)
            _mm512_storeu_si512(s.p2.data() + i * RB + x * kW,
                                bf16_pairs(_mm512_loadu_ps(pt + 2 * i * RB + x * kW), _mm512_loadu_ps(pt + (2 * i + 1) * RB + x * kW)));
#endif
      for (int64_t d0 = 0; d0 < D; d0 += kPass) {  // acc[d][lane] = alpha acc[d][lane] + sum_j p[j][lane] v[j][d]
        Vec a[kPass][2];
        for (int64_t dd = 0; dd < kPass; ++dd) {
          a[dd][0] = Vec::loadu(ab + (d0 + dd) * R) * alpha[0];
          a[dd][1] = Vec::loadu(ab + (d0 + dd) * R + kW) * alpha[1];
        }
        if constexpr (Bf16) {
#ifdef SS_CHUNK_BF16
          for (int64_t i = 0; i < (kn + 1) / 2; ++i) {
            const __m512i p0 = _mm512_loadu_si512(s.p2.data() + i * RB), p1 = _mm512_loadu_si512(s.p2.data() + i * RB + kW);
            for (int64_t dd = 0; dd < kPass; ++dd) {
              const uint32_t vv = v2[i * D + d0 + dd];
              a[dd][0] = dot_bf16(a[dd][0], p0, vv);
              a[dd][1] = dot_bf16(a[dd][1], p1, vv);
            }
          }
#endif
        } else {
          for (int64_t j = 0; j < kn; ++j) {
            const Vec p0 = Vec::loadu(pt + j * RB), p1 = Vec::loadu(pt + j * RB + kW);
            for (int64_t dd = 0; dd < kPass; ++dd) {
              const Vec vv(vt[j * D + d0 + dd]);
              a[dd][0] = at::vec::fmadd(p0, vv, a[dd][0]);
              a[dd][1] = at::vec::fmadd(p1, vv, a[dd][1]);
            }
          }
        }
        for (int64_t dd = 0; dd < kPass; ++dd) {
          a[dd][0].store(ab + (d0 + dd) * R);
          a[dd][1].store(ab + (d0 + dd) * R + kW);
        }
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t row = g * T + i;
      const float inv = 1.f / s.l[row];
      float* dst = out + (row0 + i) * heads * D + (h * group + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = s.acc[d * R + row] * inv;
    }
}

#ifdef SS_CHUNK_BF16
// Key tile k0 of one request and kv head (keys past `keys` zero) into its Bf16Rows.
template <typename C, int64_t D>
void convert_tile(const C* k_cache, const C* v_cache, const int64_t* table, int64_t keys, int64_t k0, int64_t h,
                  int64_t kv_heads, int64_t bs, uint32_t* k2, uint32_t* v2) {
  auto* k16 = reinterpret_cast<uint16_t*>(k2 + k0 * D / 2);  // a key's bfloat16 in order are its pairs
  Vec kr[D / kW], vr[2][D / kW];
  for (int64_t j = 0; j < kKeyTile; ++j) {
    const int64_t p = k0 + j;
    if (p < keys) {
      const int64_t off = row_offset<C, D>(table, p, h, kv_heads, bs);
      load_scaled_row<C, D>(k_cache + off, kr);
      load_scaled_row<C, D>(v_cache + off, vr[j % 2]);
    } else {
      for (int64_t x = 0; x < D / kW; ++x) kr[x] = vr[j % 2][x] = Vec(0.f);
    }
    for (int64_t x = 0; x < D / kW; ++x)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(k16 + j * D + x * kW), (__m256i)_mm512_cvtneps_pbh(kr[x]));
    if (j % 2 == 1)
      for (int64_t x = 0; x < D / kW; ++x)
        _mm512_storeu_si512(v2 + (k0 + j) / 2 * D + x * kW, bf16_pairs(vr[0][x], vr[1][x]));
  }
}
#endif

// The long chunks `chunks` (request indices) of a float32 step (a batch of them: see
// attend_chunks): with `bf16`, their keys and values converted to bfloat16 first (tiles in
// parallel), then every item in parallel, largest first, each thread taking the next one
// (chunks of different lengths and the causal triangle make items unequal).
template <typename C, int64_t D>
void attend_chunk_batch(const at::Tensor& q, at::Tensor& out, const at::Tensor& kc, const at::Tensor& vc,
                        const std::vector<int64_t>& chunks, float scale, bool bf16) {
  const int64_t heads = q.size(1), kv_heads = kc.size(2), bs = kc.size(1), group = heads / kv_heads;
  const auto* qsl = g_state.query_start_loc.data_ptr<int64_t>();
  const auto* lens = g_state.seq_lens.data_ptr<int64_t>();
  const auto* tables = g_state.block_tables.data_ptr<int64_t>();
  const int64_t table_width = g_state.block_tables.size(1);
  std::vector<ChunkItem> items;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int64_t r = chunks[c], n = qsl[r + 1] - qsl[r];
    for (int64_t t0 = 0; t0 < n; t0 += kChunkTokens)
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back({r, static_cast<int64_t>(c), h, t0, (lens[r] - n + std::min(n, t0 + kChunkTokens)) * group});
  }
  std::stable_sort(items.begin(), items.end(), [](const ChunkItem& a, const ChunkItem& b) { return a.cost > b.cost; });
  const float* q_ptr = q.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const C* k_ptr = kc.data_ptr<C>();
  const C* v_ptr = vc.data_ptr<C>();
  // the bf16 path: every chunk's keys and values in bfloat16 once, [chunk][kv head][keys]
  std::vector<int64_t> first(chunks.size() + 1, 0);  // a chunk's first padded key in `converted`
  for (size_t c = 0; c < chunks.size(); ++c)
    first[c + 1] = first[c] + padded_keys(lens[chunks[c]]);
  // one op call at a time (the step's metadata is this file's one registry too); it keeps
  // its largest size, at most kConvertedBytes or one chunk's keys
  static std::vector<uint32_t> converted;
#ifdef SS_CHUNK_BF16
  if (bf16) {
    converted.resize(first.back() * kv_heads * D);  // K: keys x D / 2 words, V: keys / 2 x D
    std::vector<std::array<int64_t, 3>> tiles;      // (chunk, kv head, first key)
    for (size_t c = 0; c < chunks.size(); ++c)
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t k0 = 0; k0 < lens[chunks[c]]; k0 += kKeyTile) tiles.push_back({static_cast<int64_t>(c), h, k0});
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto [c, h, k0] = tiles[i];
        uint32_t* base = converted.data() + (first[c] * kv_heads + h * (first[c + 1] - first[c])) * D;
        convert_tile<C, D>(k_ptr, v_ptr, tables + chunks[c] * table_width, lens[chunks[c]], k0, h, kv_heads, bs,
                           base, base + (first[c + 1] - first[c]) * D / 2);
      }
    });
  }
#endif
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(count, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    thread_local ChunkScratch scratch;
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
      const ChunkItem& it = items[i];
      const int64_t n = qsl[it.req + 1] - qsl[it.req], nt = std::min(kChunkTokens, n - it.t0);
      const int64_t row0 = qsl[it.req] + it.t0, pos0 = lens[it.req] - n + it.t0;
      const int64_t* table = tables + it.req * table_width;
      if (bf16) {
        const int64_t keys = first[it.chunk + 1] - first[it.chunk];
        const uint32_t* base = converted.data() + (first[it.chunk] * kv_heads + it.head * keys) * D;
        attend_chunk_item<C, D, kChunkBf16>(q_ptr, o_ptr, k_ptr, v_ptr, table, row0, nt, pos0, it.head, group, heads,
                                            kv_heads, bs, scale, {base, base + keys * D / 2}, scratch);
      } else {
        attend_chunk_item<C, D, false>(q_ptr, o_ptr, k_ptr, v_ptr, table, row0, nt, pos0, it.head, group, heads,
                                       kv_heads, bs, scale, {}, scratch);
      }
    }
  });
}

// The bf16 path's converted keys and values take at most this many bytes at once: a step's
// chunks go through in batches that fit (one chunk alone may pass it: 8,192 keys of 8 kv
// heads of 128 take 32 MiB), so many short chunks over long cached contexts do not hold a
// copy of all those contexts.
constexpr int64_t kConvertedBytes = int64_t{64} << 20;

template <typename C, int64_t D>
void attend_chunks(const at::Tensor& q, at::Tensor& out, const at::Tensor& kc, const at::Tensor& vc,
                   const std::vector<int64_t>& chunks, float scale) {
  if (!(kChunkBf16 && g_state.chunk_bf16)) return attend_chunk_batch<C, D>(q, out, kc, vc, chunks, scale, false);
  const auto* lens = g_state.seq_lens.data_ptr<int64_t>();
  const int64_t key_bytes = kc.size(2) * D * 4;  // K and V of every kv head, two bytes a value
  std::vector<int64_t> batch;
  int64_t bytes = 0;
  for (const int64_t r : chunks) {
    const int64_t b = padded_keys(lens[r]) * key_bytes;
    if (!batch.empty() && bytes + b > kConvertedBytes) {
      attend_chunk_batch<C, D>(q, out, kc, vc, batch, scale, true);
      batch.clear();
      bytes = 0;
    }
    batch.push_back(r);
    bytes += b;
  }
  if (!batch.empty()) attend_chunk_batch<C, D>(q, out, kc, vc, batch, scale, true);
}

// Every query token of the short requests.
template <typename C, typename Q>
void attend_short(const at::Tensor& q, at::Tensor& out, const at::Tensor& kc, const at::Tensor& vc,
                  const std::vector<int64_t>& tokens, const std::vector<int64_t>& token_req,
                  const std::vector<int64_t>& token_len, float scale) {
  const int64_t heads = q.size(1), d = q.size(2), kv_heads = kc.size(2), bs = kc.size(1);
  if (d == 64 && kSpan % bs == 0) return attend_spans<C, Q, 64>(q, out, kc, vc, tokens, token_req, token_len, scale);
  if (d == 128 && kSpan % bs == 0) return attend_spans<C, Q, 128>(q, out, kc, vc, tokens, token_req, token_len, scale);
  const int64_t group = heads / kv_heads, n = static_cast<int64_t>(tokens.size());
  const auto* tables = g_state.block_tables.data_ptr<int64_t>();
  const int64_t table_width = g_state.block_tables.size(1);
  const C* k_ptr = kc.data_ptr<C>();
  const C* v_ptr = vc.data_ptr<C>();
  const Q* q_ptr = q.data_ptr<Q>();
  Q* o_ptr = out.data_ptr<Q>();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / kv_heads, h = item % kv_heads, t = tokens[i];
      const int64_t offset = (t * heads + h * group) * d;
      attend_token_any<C, Q>(q_ptr + offset, o_ptr + offset, k_ptr, v_ptr, tables + token_req[i] * table_width,
                             token_len[i], h, group, kv_heads, d, bs, scale, scores);
    }
  });
}

// Cache rows [..., row] as values [..., d] of type t (an int8 row's times its scale).
at::Tensor cache_values(const at::Tensor& rows, int64_t d, at::ScalarType t) {
  if (rows.scalar_type() != at::kChar) return rows.to(t);
  const auto scale = rows.narrow(-1, d, 4).contiguous().view(at::kFloat);  // [..., 1]
  return (rows.narrow(-1, 0, d).to(at::kFloat) * scale).to(t);
}

// A long chunk [start, end) of request r through SDPA.
at::Tensor attend_long(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                       const at::Tensor& vc, int64_t r, int64_t start, int64_t end, int64_t seq_len) {
  const int64_t n = end - start, bs = kc.size(1);
  auto query = q.slice(0, start, end).transpose(0, 1).unsqueeze(0);
  at::Tensor keys, values;
  c10::optional<at::Tensor> mask;
  bool causal = true;
  if (seq_len == n && kc.scalar_type() != at::kChar) {  // nothing cached before: the fresh K/V (an int8 cache's rows are read, as attend_chunks does)
    keys = k.slice(0, start, end);
    values = v.slice(0, start, end);
  } else {
    const int64_t blocks = (seq_len + bs - 1) / bs;
    auto ids = g_state.block_tables[r].slice(0, 0, blocks);
    keys = kc.index_select(0, ids).flatten(0, 1).slice(0, 0, seq_len);
    values = vc.index_select(0, ids).flatten(0, 1).slice(0, 0, seq_len);
    // query i sits at position seq_len - n + i and sees keys at positions <= its own
    auto key_pos = at::arange(seq_len, q.options().dtype(at::kLong));
    mask = key_pos.unsqueeze(0) <= key_pos.slice(0, seq_len - n, seq_len).unsqueeze(1);
    causal = false;
  }
  const int64_t d = q.size(2);
  auto o = at::scaled_dot_product_attention(query, cache_values(keys, d, q.scalar_type()).transpose(0, 1).unsqueeze(0),
                                            cache_values(values, d, q.scalar_type()).transpose(0, 1).unsqueeze(0), mask, 0.0,
                                            causal, c10::nullopt, /*enable_gqa=*/true);
  return o.squeeze(0).transpose(0, 1);
}

// f(C{}) with C the cache's element type: float, at::BFloat16, at::Half or int8_t.
template <typename F>
void with_cache_type(const at::Tensor& cache, F&& f) {
  switch (cache.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kHalf: return f(at::Half{});
    case at::kChar: return f(int8_t{});
    default: TORCH_CHECK(false, "KV cache must be float32, bfloat16, float16 or int8, got ", cache.scalar_type());
  }
}

// d values of `src` as one int8 cache row at `out`: d int8 values, then their scale,
// max |x| / 127, in 4 bytes; rounded to nearest even (as kv_rows.quantize_rows does). `x`:
// d floats of scratch.
template <typename S>
void quantize_row(const S* src, int64_t d, int8_t* out, float* x) {
  at::vec::convert(src, x, d);
  Vec vmax(0.f);
  int64_t i = 0;
  for (; i + kW <= d; i += kW) vmax = at::vec::maximum(vmax, Vec::loadu(x + i).abs());
  float amax = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; i < d; ++i) amax = std::max(amax, std::abs(x[i]));
  const float scale = amax / 127.f;
  if (scale > 0.f) {
    const Vec s(scale);
    for (i = 0; i + kW <= d; i += kW) (Vec::loadu(x + i) / s).round().store(x + i);
    for (; i < d; ++i) x[i] = std::nearbyint(x[i] / scale);
  } else {
    std::fill(x, x + d, 0.f);
  }
  for (i = 0; i < d; ++i) out[i] = static_cast<int8_t>(x[i]);
  std::memcpy(out + d, &scale, sizeof scale);
}

// Rows [T, kv_heads * d] of `src` (row stride `stride`: k and v are views into the fused qkv
// product) into the cache rows `slots`, converted to the cache's type on the way (into an
// int8 cache, each (token, kv head)'s d values as one quantized row).
template <typename S, typename C>
void copy_rows(const S* src, int64_t stride, C* dst, const int64_t* slots, int64_t T, int64_t kv_heads, int64_t d) {
  const int64_t width = kv_heads * d;
  auto rows = [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kScaleBytes<C> != 0 ? d : 0);  // empty (no allocation) unless int8
    for (int64_t t = begin; t < end; ++t) {
      if constexpr (kScaleBytes<C> != 0) {
        for (int64_t h = 0; h < kv_heads; ++h)
          quantize_row(src + t * stride + h * d, d, dst + (slots[t] * kv_heads + h) * (d + kScaleBytes<C>),
                       scratch.data());
      } else if constexpr (std::is_same_v<S, C>) {
        std::memcpy(dst + slots[t] * width, src + t * stride, width * sizeof(C));
      } else {
        at::vec::convert(src + t * stride, dst + slots[t] * width, width);
      }
    }
  };
  at::parallel_for(0, T, 256, rows);  // a decode batch's few rows on the calling thread
}

// This step's K/V [T, kv_heads, D] into the layer's cache at slot_mapping. A direct copy:
// index_copy_ over a converted temporary measured ~5 us a layer of dispatch and allocation
// for one decode token, more than that token's attention.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kc, at::Tensor& vc) {
  const auto& slots = g_state.slot_mapping;
  const int64_t T = k.size(0), kv_heads = kc.size(2), capacity = kc.size(0) * kc.size(1);
  TORCH_CHECK(slots.size(0) == T && v.size(0) == T, "slot_mapping has ", slots.size(0), " slots for ", T, " tokens");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must have one dtype");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(0 <= sp[t] && sp[t] < capacity, "slot ", sp[t], " outside the cache");
  for (auto [src, cache] : {std::pair<const at::Tensor*, at::Tensor*>{&k, &kc}, {&v, &vc}}) {
    // rows of kv_heads * D contiguous values, at any row stride
    const bool rows_dense = src->dim() == 3 && src->stride(2) == 1 && src->stride(1) == src->size(2);
    const at::Tensor rows = rows_dense ? *src : src->contiguous();
    const int64_t d = rows.size(2);
    with_cache_type(*cache, [&](auto cache_type) {
      using C = decltype(cache_type);
      TORCH_CHECK(rows.size(1) == kv_heads && cache->size(3) == d + kScaleBytes<C>,
                  "K/V rows do not match the cache's kv_heads and row size");
      C* dst = cache->data_ptr<C>();
      if (rows.scalar_type() == at::kFloat)
        copy_rows(rows.data_ptr<float>(), rows.stride(0), dst, sp, T, kv_heads, d);
      else if (rows.scalar_type() == at::kBFloat16)
        copy_rows(rows.data_ptr<at::BFloat16>(), rows.stride(0), dst, sp, T, kv_heads, d);
      else if (rows.scalar_type() == at::kHalf)
        copy_rows(rows.data_ptr<at::Half>(), rows.stride(0), dst, sp, T, kv_heads, d);
      else
        TORCH_CHECK(false, "K/V must be float32, bfloat16 or float16, got ", rows.scalar_type());
    });
  }
}

}  // namespace

void set_kv_cache(std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), "as many K as V caches");
  for (const auto& c : k_caches) TORCH_CHECK(c.is_contiguous() && c.dim() == 4, "caches: contiguous [blocks, bs, kv_heads, d]");
  g_state.k_caches = std::move(k_caches);
  g_state.v_caches = std::move(v_caches);
}

void bind_step(at::Tensor slot_mapping, at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor block_tables,
               int64_t small_query, bool chunk_bf16) {
  g_state.slot_mapping = slot_mapping.to(at::kLong).contiguous();
  g_state.query_start_loc = query_start_loc.to(at::kLong).contiguous();
  g_state.seq_lens = seq_lens.to(at::kLong).contiguous();
  g_state.block_tables = block_tables.to(at::kLong).contiguous();
  g_state.small_query = small_query;
  g_state.chunk_bf16 = chunk_bf16 && kChunkBf16;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(g_state.k_caches.size()), "no KV cache for layer ", layer);
  auto kc = g_state.k_caches[layer], vc = g_state.v_caches[layer];
  write_kv(k, v, kc, vc);
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  const auto* qsl = g_state.query_start_loc.data_ptr<int64_t>();
  const auto* lens = g_state.seq_lens.data_ptr<int64_t>();
  const int64_t num_reqs = g_state.seq_lens.size(0);
  const int64_t d = qc.size(2);
  const bool chunk_kernel = g_state.chunk_kernel && qc.scalar_type() == at::kFloat && (d == 64 || d == 128);
  thread_local std::vector<int64_t> tokens_buf, token_req_buf, token_len_buf, chunks_buf;
  auto& tokens = tokens_buf;  // references: see attend_spans
  auto& token_req = token_req_buf;
  auto& token_len = token_len_buf;
  auto& chunks = chunks_buf;
  tokens.clear();
  token_req.clear();
  token_len.clear();
  chunks.clear();
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t start = qsl[r], end = qsl[r + 1], n = end - start;
    if (n > g_state.small_query) {
      if (chunk_kernel)
        chunks.push_back(r);
      else
        out.slice(0, start, end).copy_(attend_long(qc, k, v, kc, vc, r, start, end, lens[r]));
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {  // query i at position lens[r] - n + i sees that many + 1 keys
      tokens.push_back(start + i);
      token_req.push_back(r);
      token_len.push_back(lens[r] - n + i + 1);
    }
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  if (!chunks.empty())
    with_cache_type(kc, [&](auto cache_type) {
      using C = decltype(cache_type);
      if (d == 64)
        attend_chunks<C, 64>(qc, out, kc, vc, chunks, scale);
      else
        attend_chunks<C, 128>(qc, out, kc, vc, chunks, scale);
    });
  if (!tokens.empty()) {
    const bool q_bf16 = qc.scalar_type() == at::kBFloat16;
    TORCH_CHECK(q_bf16 || qc.scalar_type() == at::kFloat, "queries must be float32 or bfloat16");
    with_cache_type(kc, [&](auto cache_type) {
      using C = decltype(cache_type);
      if (q_bf16)
        attend_short<C, at::BFloat16>(qc, out, kc, vc, tokens, token_req, token_len, scale);
      else
        attend_short<C, float>(qc, out, kc, vc, tokens, token_req, token_len, scale);
    });
  }
  return out;
}

TORCH_LIBRARY(stepserve_cpu, m) {
  m.def("set_kv_cache(Tensor[] k_caches, Tensor[] v_caches) -> ()", &set_kv_cache);
  // chunk_bf16: attend_chunks' two products as AVX512-BF16 dot products where the build has
  // them (chunk_bf16_supported), else float32 FMAs
  m.def("bind_step(Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, int small_query, "
        "bool chunk_bf16=False) -> ()",
        &bind_step);
  m.def("chunk_bf16_supported() -> bool", []() { return kChunkBf16; });
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor");
  // which path long chunks of float32 queries take: attend_chunks (default) or SDPA (to compare the two)
  m.def("set_chunk_kernel(bool on) -> ()", [](bool on) { g_state.chunk_kernel = on; });
}

// CPU only: a compiled forward traces the op with the fake kernel registered from Python.
TORCH_LIBRARY_IMPL(stepserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
