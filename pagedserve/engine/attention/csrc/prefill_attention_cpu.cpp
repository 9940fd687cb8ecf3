// Causal attention of one sequence's new tokens over its context, float32, for CPU prefills: the
// loop order of FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and
// Work Partitioning", 2023, Algorithm 1: a block of query rows stays put while blocks of keys pass,
// with an online softmax), its two products in register blocks as in a BLIS GEMM (6 rows x 16
// columns of sums in 12 ymm registers; panel_gemm_f32.cpp does the same for the linear layers).
//
// A work item is one KV head and up to kItemRows of its query rows, token-major (row t * G + g: token t,
// the g-th of the G query heads that share the KV head in grouped-query attention), so each key panel
// and value row loaded serves them all. Per block of kKeyBlock keys: scores S = Q K^T (K packed once per
// call into panels of 16 keys, d-major), the causal mask on the blocks that cross the diagonal, the
// running max and sum of each row rescaled, P = exp(S - max), O += P V (V read in place). Keys past
// every row's last are never scored. Every row's sums run over d = 0 .. D-1 and keys in order; the
// order depends only on D and the key-block boundaries (multiples of kKeyBlock), not on the thread
// count or other rows.
//
// Layouts:
//   query, out  float32 [q, H, D]     the sequence's q new tokens, positions L - q .. L - 1
//   key, value  float32 [L, Hkv, D]   its whole context, the new tokens last (each row's D floats
//                                     contiguous; any strides over the first two dimensions)
//   token i (0-based among the new ones) reads keys 0 .. L - q + i; H a multiple of Hkv; D of 16.
// prefill_attention_paged reads the context in place from one layer's caches [NB, BS, Hkv, D] (float32)
// through block_ids int64 [>= ceil(L / BS)]: position p is row p % BS of block block_ids[p / BS]; the
// same arithmetic in the same order as over a gathered copy.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <omp.h>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the prefill attention op needs AVX2 and FMA"
#endif

namespace {

constexpr int64_t kLanes = 16;     // vec16.h's vector width: the softmax works 16 scores at a time
constexpr int64_t kKeyTile = 16;   // vec16.h's transpose_sum (not used here)
#include "vec16.h"  // vf16, exp_nonpositive, splat

constexpr int64_t kRows = 6;        // rows of a register block: 6 x 2 sums + 2 loads + 1 broadcast = 15 registers
constexpr int64_t kCols = 16;       // keys of a K panel, output columns of a P V block
constexpr int64_t kKeyBlock = 64;   // keys per online-softmax step: 4 panels, 16 KiB of V at D = 64
constexpr int64_t kItemRows = 48;   // query rows (positions x heads of a group) per work item, at most

struct Shape {
  int64_t q, L, H, Hkv, G, D;
  int64_t offset;  // L - q: new token i reads keys 0 .. offset + i
  float scale;
  int64_t panels_per_head() const { return (L + kCols - 1) / kCols; }
};

#include "kv_rows.h"  // KvRows, strided_rows, paged_rows
#include "key_panels.h"  // pack_panel

// scores[r][0..15] = sum over d of q[r][d] * panel[d][0..15], for kRows rows D floats apart.
inline void score_block(const float* q, int64_t D, const float* panel, float* scores) {
  __m256 acc[kRows][2];
  for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
  const float* rows[kRows];  // each row's next query element
  for (int64_t r = 0; r < kRows; ++r) rows[r] = q + r * D;
  for (const float* const end = panel + D * kCols; panel != end; panel += kCols) {
    const __m256 b0 = _mm256_loadu_ps(panel), b1 = _mm256_loadu_ps(panel + 8);
    for (int64_t r = 0; r < kRows; ++r) {
      const __m256 a = _mm256_broadcast_ss(rows[r]++);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(scores + r * kKeyBlock, acc[r][0]);
    _mm256_storeu_ps(scores + r * kKeyBlock + 8, acc[r][1]);
  }
}

// o[r][0..15] += sum over k < nk of p[r][k] * v[k][0..15], for kRows rows (o D floats apart, p
// kKeyBlock apart) and value rows v[k] + offset.
inline void value_block(const float* p, const float* const* v, int64_t offset, int64_t nk, float* o, int64_t D) {
  __m256 acc[kRows][2];
  for (int64_t r = 0; r < kRows; ++r)
    acc[r][0] = _mm256_loadu_ps(o + r * D), acc[r][1] = _mm256_loadu_ps(o + r * D + 8);
  for (int64_t k = 0; k < nk; ++k) {
    const __m256 b0 = _mm256_loadu_ps(v[k] + offset), b1 = _mm256_loadu_ps(v[k] + offset + 8);
    for (int64_t r = 0; r < kRows; ++r) {
      const __m256 a = _mm256_broadcast_ss(p + r * kKeyBlock + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    _mm256_storeu_ps(o + r * D, acc[r][0]), _mm256_storeu_ps(o + r * D + 8, acc[r][1]);
}

// One thread's rows of a work item: scaled queries, unnormalised outputs, scores, running max and sum.
struct Rows {
  std::vector<float> q, o, s, max, sum;
  std::vector<int64_t> last_key;  // the row's last readable key
  explicit Rows(int64_t D)
      : q(kItemRows * D), o(kItemRows * D), s(kItemRows * kKeyBlock), max(kItemRows), sum(kItemRows),
        last_key(kItemRows) {}
};

// Turns row r's scores of the keys k0 .. k0 + nk - 1 into probabilities against its updated running max,
// rescaling its sum and output (FlashAttention's online softmax). Keys past the row's last get 0.
inline void softmax_row(Rows& rows, int64_t r, int64_t k0, int64_t nk, int64_t D) {
  float* s = rows.s.data() + r * kKeyBlock;
  const int64_t valid = std::min(nk, rows.last_key[r] - k0 + 1);
  if (valid <= 0) {
    std::fill(s, s + kKeyBlock, 0.0f);
    return;
  }
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  vf16 scores[kKeyBlock / kLanes], block_max = splat(kMinusInf);
  for (int64_t c = 0; c < kKeyBlock / kLanes; ++c) {
    scores[c] = first_lanes(load_floats(s + c * kLanes), valid - c * kLanes, kMinusInf);
    block_max = where_less(block_max, scores[c], scores[c], block_max);
  }
  const float new_max = std::max(rows.max[r], reduce_max(block_max));
  const float alpha = std::exp(rows.max[r] - new_max);  // 0 on the row's first block (max -inf)
  vf16 total{};
  for (int64_t c = 0; c < kKeyBlock / kLanes; ++c) {
    const vf16 prob = exp_nonpositive(scores[c] - new_max);
    __builtin_memcpy(s + c * kLanes, &prob, sizeof prob);
    total += prob;
  }
  const float block_sum = reduce_sum(total);
  rows.sum[r] = rows.sum[r] * alpha + block_sum;
  rows.max[r] = new_max;
  if (alpha != 1.0f) {
    float* o = rows.o.data() + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
  }
}

struct Item {
  int64_t head;   // KV head
  int64_t first;  // first query row of the head (token-major)
  int64_t count;  // query rows, at most kItemRows
};

// out rows of one work item: attention of its query rows over the keys its last token reads.
void run_item(const Item& item, const Shape& s, const at::Tensor& query, const KvRows& kv,
              const float* key_panels, at::Tensor& out, Rows& rows) {
  const int64_t R = item.count, padded = (R + kRows - 1) / kRows * kRows, D = s.D;
  const float* qsrc = query.data_ptr<float>();
  for (int64_t r = 0; r < padded; ++r) {  // padding rows repeat the last real row; never stored
    const int64_t row = item.first + std::min(r, R - 1), t = row / s.G, h = item.head * s.G + row % s.G;
    for (int64_t d = 0; d < D; ++d) rows.q[r * D + d] = qsrc[(t * s.H + h) * D + d] * s.scale;
    rows.last_key[r] = s.offset + t;
    rows.max[r] = -std::numeric_limits<float>::infinity();
    rows.sum[r] = 0.0f;
  }
  std::fill(rows.o.begin(), rows.o.begin() + padded * D, 0.0f);
  const int64_t keys = s.offset + (item.first + R - 1) / s.G + 1;
  const float* panels = key_panels + item.head * s.panels_per_head() * D * kCols;
  const int64_t v_offset = item.head * kv.value_head_stride;
  for (int64_t k0 = 0; k0 < keys; k0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, keys - k0);
    for (int64_t r = 0; r < padded; r += kRows)
      for (int64_t j = 0; j < nk; j += kCols)
        score_block(rows.q.data() + r * D, D, panels + (k0 + j) / kCols * D * kCols, rows.s.data() + r * kKeyBlock + j);
    for (int64_t r = 0; r < padded; ++r) softmax_row(rows, r, k0, nk, D);
    for (int64_t r = 0; r < padded; r += kRows)
      for (int64_t c = 0; c < D; c += kCols)
        value_block(rows.s.data() + r * kKeyBlock, kv.value.data() + k0, v_offset + c, nk, rows.o.data() + r * D + c,
                    D);
  }
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = (item.first + r) / s.G, h = item.head * s.G + (item.first + r) % s.G;
    const float inv = 1.0f / rows.sum[r];
    for (int64_t d = 0; d < D; ++d) dst[(t * s.H + h) * D + d] = rows.o[r * D + d] * inv;
  }
}

// The shape of a call over L context positions of kv_heads KV heads of kv_dim floats, checked.
Shape checked_shape(const at::Tensor& out, const at::Tensor& query, int64_t L, int64_t kv_heads, int64_t kv_dim,
                    double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [q, H, D]");
  for (const at::Tensor* t : {&out, &query})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                "query and out must be contiguous float32 on the CPU");
  const Shape s{query.size(0), L, query.size(1), kv_heads, query.size(1) / std::max<int64_t>(kv_heads, 1),
                query.size(2), L - query.size(0), static_cast<float>(scale)};
  TORCH_CHECK(s.Hkv > 0 && s.H > 0 && s.H % s.Hkv == 0 && kv_dim == s.D && s.D % kCols == 0 && s.D > 0,
              "heads must be a multiple of KV heads, head_dim must match and be a multiple of 16");
  TORCH_CHECK(s.q >= 1 && s.q <= s.L, "query length ", s.q, " not in 1..context length ", s.L);
  return s;
}

// out = the attention of s's rows over the context rows kv (checked by the callers below).
void attend(at::Tensor& out, const at::Tensor& query, const KvRows& kv, const Shape& s) {
  // kItemRows rows per item; on several threads fewer (multiples of kRows) where that leaves under 4 items a
  // thread: a 16-token chunk of the default model is 48 rows per KV head, 18 + 18 + 12 on 2 threads.
  const int64_t rows_per_head = s.q * s.G, threads = at::get_num_threads();
  const int64_t even_share = (rows_per_head * s.Hkv + 4 * threads - 1) / (4 * threads);
  const int64_t rows_per_item =
      threads == 1 ? kItemRows : std::clamp((even_share + kRows - 1) / kRows * kRows, kRows, kItemRows);
  std::vector<Item> items;  // costliest (last tokens) first: threads claim them in this order
  for (int64_t first = (rows_per_head - 1) / rows_per_item * rows_per_item; first >= 0; first -= rows_per_item)
    for (int64_t h = 0; h < s.Hkv; ++h) items.push_back({h, first, std::min(rows_per_item, rows_per_head - first)});
  const int64_t num_panels = s.Hkv * s.panels_per_head(), n = static_cast<int64_t>(items.size());
  std::unique_ptr<float[]> panels(new float[num_panels * s.D * kCols]);  // not zeroed: pack_panel writes all
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads)  // one team packs the panels, then runs the items
  {
#pragma omp for schedule(static)
    for (int64_t hp = 0; hp < num_panels; ++hp) pack_panel(kv, s, hp, panels.get());
    Rows rows(s.D);  // the loop's implicit barrier: every panel is packed
    for (int64_t i = claimed.fetch_add(1); i < n; i = claimed.fetch_add(1))
      run_item(items[i], s, query, kv, panels.get(), out, rows);
  }
}

// out[q, H, D] = causal attention of query[q, H, D] over key/value[L, Hkv, D] (see the layouts above).
void prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       double scale) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [L, Hkv, D]");
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(2) == 1,
                "key and value must be float32 on the CPU, each row contiguous");
  const Shape s = checked_shape(out, query, key.size(0), key.size(1), key.size(2), scale);
  attend(out, query, strided_rows(key, value), s);
}

// The same over the first context_len + q positions of a sequence's blocks block_ids in one layer's cache.
void prefill_attention_paged(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_ids, int64_t context_len,
                             double scale) {
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "key_cache and value_cache must be [NB, BS, Hkv, D]");
  for (const at::Tensor* t : {&key_cache, &value_cache})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                "the caches must be contiguous float32 on the CPU");
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == at::kLong && block_ids.is_contiguous() &&
                  block_ids.device().is_cpu(), "block_ids must be contiguous int64 [blocks] on the CPU");
  TORCH_CHECK(query.dim() == 3, "query must be [q, H, D]");
  const int64_t block_size = key_cache.size(1);
  TORCH_CHECK(context_len >= 0 && context_len <= key_cache.size(0) * block_size, "context_len ", context_len,
              " not in 0..", key_cache.size(0) * block_size, " (the cache's slots)");
  const int64_t L = context_len + query.size(0), blocks = (L + block_size - 1) / std::max<int64_t>(block_size, 1);
  TORCH_CHECK(block_size > 0 && block_ids.size(0) >= blocks, "positions 0..", L - 1, " need ", blocks,
              " blocks, block_ids has ", block_ids.size(0));
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < blocks; ++b)
    TORCH_CHECK(ids[b] >= 0 && ids[b] < key_cache.size(0), "block id ", ids[b], " outside the cache of ",
                key_cache.size(0), " blocks");
  const Shape s = checked_shape(out, query, L, key_cache.size(2), key_cache.size(3), scale);
  attend(out, query, paged_rows(key_cache, value_cache, ids, L), s);
}

}  // namespace

TORCH_LIBRARY(pagedserve_prefill, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, float scale) -> ()");
  m.def("prefill_attention_paged(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_ids, int context_len, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_prefill, CPU, m) {
  m.impl("prefill_attention", TORCH_FN(prefill_attention));
  m.impl("prefill_attention_paged", TORCH_FN(prefill_attention_paged));
}
