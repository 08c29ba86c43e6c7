// Paged attention on the CPU, reading the KV cache in place (no gathered copy per layer).
//
// One op per layer, stepserve_cpu::paged_attention(q, k, v, layer) -> out [T, H, D]:
//   1. write this step's K/V [T, KVH, D] into the layer's cache at slot_mapping;
//   2. every query token of a request with at most `small_query` tokens (decodes, short
//      chunks) attends to the first (position + 1) keys of its request, read block by block
//      through the block table: one work item per (token, kv head), in parallel;
//   3. each longer chunk runs torch's SDPA (its flash kernel) over the fresh K/V when
//      nothing was cached before it, else over its blocks gathered once for all heads.
//
// The cache tensors and the step's metadata live in this file's registry (set_kv_cache,
// bind_step), not in the op's arguments: a compiled forward then sees an op without
// mutated inputs (nothing for the compiler to functionalize or guard) and changing
// metadata never recompiles it. Caches: [num_blocks, block_size, kv_heads, head_dim],
// float32 or bfloat16, contiguous.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

struct StepState {
  std::vector<at::Tensor> k_caches, v_caches;
  at::Tensor slot_mapping;     // [T] int64
  at::Tensor query_start_loc;  // [B + 1] int64 (host)
  at::Tensor seq_lens;         // [B] int64 (host)
  at::Tensor block_tables;     // [B, max_blocks] int64 (host)
  int64_t small_query = 16;
};

StepState g_state;

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

// One K or V row of D values as D / kW float vectors, converted on the fly.
template <int64_t D>
inline void load_row(const float* src, Vec* out) {
  for (int64_t j = 0; j < D / kW; ++j) out[j] = Vec::loadu(src + j * kW);
}
template <int64_t D>
inline void load_row(const at::BFloat16* src, Vec* out) {
  using BVec = at::vec::Vectorized<at::BFloat16>;  // 2 * kW values
  for (int64_t j = 0; j < D / kW; j += 2) {
    auto [lo, hi] = at::vec::convert_bfloat16_float(BVec::loadu(src + j * kW));
    out[j] = lo;
    out[j + 1] = hi;
  }
}

inline float reduce(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// Per-thread buffers, grown once.
struct Scratch {
  std::vector<float> scores;
};

// Attend the `group` query heads sharing kv head `h` for one token at context length L.
// Each head streams its K and V rows (L1/L2-resident after the first head) with its
// accumulators in registers: D is a template parameter so the loops over vectors unroll.
template <typename C, typename Q, int64_t D>
void attend_token(const Q* q, Q* out, const C* k_cache, const C* v_cache, const int64_t* table,
                  int64_t L, int64_t h, int64_t group, int64_t kv_heads, int64_t bs, float scale, Scratch& s) {
  constexpr int64_t V = D / kW;
  s.scores.resize(L);
  float* sc = s.scores.data();
  const int64_t token_stride = kv_heads * D, block_stride = bs * token_stride;
  Vec row[V];
  for (int64_t g = 0; g < group; ++g) {
    Vec qv[V];
    for (int64_t j = 0; j < V; ++j) {
      float buf[kW];
      for (int64_t i = 0; i < kW; ++i) buf[i] = static_cast<float>(q[g * D + j * kW + i]) * scale;
      qv[j] = Vec::loadu(buf);
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t pos = 0; pos < L; ++pos) {
      load_row<D>(k_cache + table[pos / bs] * block_stride + (pos % bs) * token_stride + h * D, row);
      Vec acc = qv[0] * row[0];
      for (int64_t j = 1; j < V; ++j) acc = at::vec::fmadd(qv[j], row[j], acc);
      sc[pos] = reduce(acc);
      m = std::max(m, sc[pos]);
    }
    const Vec vm(m);
    Vec vsum(0.f);
    int64_t p = 0;
    for (; p + kW <= L; p += kW) {
      Vec e = (Vec::loadu(sc + p) - vm).exp();
      e.store(sc + p);
      vsum = vsum + e;
    }
    float sum = reduce(vsum);
    for (; p < L; ++p) {
      sc[p] = std::exp(sc[p] - m);
      sum += sc[p];
    }
    Vec acc[V];
    for (int64_t j = 0; j < V; ++j) acc[j] = Vec(0.f);
    for (int64_t pos = 0; pos < L; ++pos) {
      load_row<D>(v_cache + table[pos / bs] * block_stride + (pos % bs) * token_stride + h * D, row);
      const Vec w(sc[pos]);
      for (int64_t j = 0; j < V; ++j) acc[j] = at::vec::fmadd(w, row[j], acc[j]);
    }
    const Vec inv(1.f / sum);
    for (int64_t j = 0; j < V; ++j) {
      float buf[kW];
      (acc[j] * inv).store(buf);
      for (int64_t i = 0; i < kW; ++i) out[g * D + j * kW + i] = static_cast<Q>(buf[i]);
    }
  }
}

// Any other head size: the same computation with plain loops.
template <typename C, typename Q>
void attend_token_any(const Q* q, Q* out, const C* k_cache, const C* v_cache, const int64_t* table, int64_t L,
                      int64_t h, int64_t group, int64_t kv_heads, int64_t d, int64_t bs, float scale, Scratch& s) {
  s.scores.resize(L);
  float* sc = s.scores.data();
  const int64_t token_stride = kv_heads * d, block_stride = bs * token_stride;
  for (int64_t g = 0; g < group; ++g) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t pos = 0; pos < L; ++pos) {
      const C* kp = k_cache + table[pos / bs] * block_stride + (pos % bs) * token_stride + h * d;
      float dot = 0.f;
      for (int64_t i = 0; i < d; ++i) dot += static_cast<float>(q[g * d + i]) * static_cast<float>(kp[i]);
      sc[pos] = dot * scale;
      m = std::max(m, sc[pos]);
    }
    float sum = 0.f;
    for (int64_t p = 0; p < L; ++p) sum += (sc[p] = std::exp(sc[p] - m));
    for (int64_t i = 0; i < d; ++i) {
      float acc = 0.f;
      for (int64_t pos = 0; pos < L; ++pos)
        acc += sc[pos] * static_cast<float>(v_cache[table[pos / bs] * block_stride + (pos % bs) * token_stride + h * d + i]);
      out[g * d + i] = static_cast<Q>(acc / sum);
    }
  }
}

// Every query token of the short requests, one (token, kv head) work item each.
template <typename C, typename Q>
void attend_short(const at::Tensor& q, at::Tensor& out, const at::Tensor& kc, const at::Tensor& vc,
                  const std::vector<int64_t>& tokens, const std::vector<int64_t>& token_req,
                  const std::vector<int64_t>& token_len, float scale) {
  const int64_t heads = q.size(1), d = q.size(2), kv_heads = kc.size(2), bs = kc.size(1);
  const int64_t group = heads / kv_heads, n = static_cast<int64_t>(tokens.size());
  const auto* tables = g_state.block_tables.data_ptr<int64_t>();
  const int64_t table_width = g_state.block_tables.size(1);
  const C* k_ptr = kc.data_ptr<C>();
  const C* v_ptr = vc.data_ptr<C>();
  const Q* q_ptr = q.data_ptr<Q>();
  Q* o_ptr = out.data_ptr<Q>();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / kv_heads, h = item % kv_heads, t = tokens[i];
      const int64_t offset = (t * heads + h * group) * d;
      const int64_t* table = tables + token_req[i] * table_width;
      const int64_t L = token_len[i];
      if (d == 64)
        attend_token<C, Q, 64>(q_ptr + offset, o_ptr + offset, k_ptr, v_ptr, table, L, h, group, kv_heads, bs, scale, scratch);
      else if (d == 128)
        attend_token<C, Q, 128>(q_ptr + offset, o_ptr + offset, k_ptr, v_ptr, table, L, h, group, kv_heads, bs, scale, scratch);
      else
        attend_token_any<C, Q>(q_ptr + offset, o_ptr + offset, k_ptr, v_ptr, table, L, h, group, kv_heads, d, bs, scale, scratch);
    }
  });
}

// A long chunk [start, end) of request r through SDPA.
at::Tensor attend_long(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                       const at::Tensor& vc, int64_t r, int64_t start, int64_t end, int64_t seq_len) {
  const int64_t n = end - start, bs = kc.size(1);
  auto query = q.slice(0, start, end).transpose(0, 1).unsqueeze(0);
  at::Tensor keys, values;
  c10::optional<at::Tensor> mask;
  bool causal = true;
  if (seq_len == n) {  // nothing cached before this chunk: the fresh K/V
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
  auto o = at::scaled_dot_product_attention(query, keys.to(q.scalar_type()).transpose(0, 1).unsqueeze(0),
                                            values.to(q.scalar_type()).transpose(0, 1).unsqueeze(0), mask, 0.0,
                                            causal, c10::nullopt, /*enable_gqa=*/true);
  return o.squeeze(0).transpose(0, 1);
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kc, at::Tensor& vc) {
  const auto slots = g_state.slot_mapping;
  kc.view({-1, kc.size(2), kc.size(3)}).index_copy_(0, slots, k.to(kc.scalar_type()));
  vc.view({-1, vc.size(2), vc.size(3)}).index_copy_(0, slots, v.to(vc.scalar_type()));
}

}  // namespace

void set_kv_cache(std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), "as many K as V caches");
  for (const auto& c : k_caches) TORCH_CHECK(c.is_contiguous() && c.dim() == 4, "caches: contiguous [blocks, bs, kv_heads, d]");
  g_state.k_caches = std::move(k_caches);
  g_state.v_caches = std::move(v_caches);
}

void bind_step(at::Tensor slot_mapping, at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor block_tables,
               int64_t small_query) {
  g_state.slot_mapping = slot_mapping.to(at::kLong).contiguous();
  g_state.query_start_loc = query_start_loc.to(at::kLong).contiguous();
  g_state.seq_lens = seq_lens.to(at::kLong).contiguous();
  g_state.block_tables = block_tables.to(at::kLong).contiguous();
  g_state.small_query = small_query;
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
  std::vector<int64_t> tokens, token_req, token_len;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t start = qsl[r], end = qsl[r + 1], n = end - start;
    if (n > g_state.small_query) {
      out.slice(0, start, end).copy_(attend_long(qc, k, v, kc, vc, r, start, end, lens[r]));
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {  // query i at position lens[r] - n + i sees that many + 1 keys
      tokens.push_back(start + i);
      token_req.push_back(r);
      token_len.push_back(lens[r] - n + i + 1);
    }
  }
  if (!tokens.empty()) {
    const float scale = 1.f / std::sqrt(static_cast<float>(q.size(2)));
    const bool cache_bf16 = kc.scalar_type() == at::kBFloat16, q_bf16 = qc.scalar_type() == at::kBFloat16;
    TORCH_CHECK(cache_bf16 || kc.scalar_type() == at::kFloat, "KV cache must be float32 or bfloat16");
    TORCH_CHECK(q_bf16 || qc.scalar_type() == at::kFloat, "queries must be float32 or bfloat16");
    if (cache_bf16 && q_bf16)
      attend_short<at::BFloat16, at::BFloat16>(qc, out, kc, vc, tokens, token_req, token_len, scale);
    else if (cache_bf16)
      attend_short<at::BFloat16, float>(qc, out, kc, vc, tokens, token_req, token_len, scale);
    else if (q_bf16)
      attend_short<float, at::BFloat16>(qc, out, kc, vc, tokens, token_req, token_len, scale);
    else
      attend_short<float, float>(qc, out, kc, vc, tokens, token_req, token_len, scale);
  }
  return out;
}

TORCH_LIBRARY(stepserve_cpu, m) {
  m.def("set_kv_cache(Tensor[] k_caches, Tensor[] v_caches) -> ()", &set_kv_cache);
  m.def("bind_step(Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, int small_query) -> ()",
        &bind_step);
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor");
}

// CPU only: a compiled forward traces the op with the fake kernel registered from Python.
TORCH_LIBRARY_IMPL(stepserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
