// Paged attention for CPU that reads K/V in place through the block table.
//
// PagedAttention (Kwon et al., SOSP 2023, §4) stores each sequence's keys and values in fixed-size
// blocks; this kernel walks a sequence's block table and never copies its context into a contiguous
// buffer. Each work item is one sequence's tile of up to kQueryTile new tokens with all its heads
// (a decode is one token): the item reads each context slot's K/V rows of every KV head once, in the
// slot's memory order, and each KV head's row serves the G query heads that share it (grouped-query
// attention). Softmax is the online (streaming) form of FlashAttention (Dao et al., NeurIPS 2022,
// §3.1, Algorithm 1): a running maximum and sum per row, rescaled block by block, so one pass over the
// context suffices. The G query heads of a token that share a KV head are updated together (up to
// kMaxGroup at a time), so each K and V vector is loaded once for all of them. All arithmetic is
// float32 whatever the dtypes: a cache narrower than float32 (the query's bfloat16 or half, or
// --kv-cache-dtype's bfloat16 or fp8_e5m2: a template parameter of its own) is widened in registers as
// it is loaded (load16, vec16.h; a bfloat16 cache 32 channels at a time as their even and odd halves,
// load_pairs). With ALiBi slopes (Press et al., 2022, §3) each scaled score of head h gets
// -slope[h] * (query_pos - key_pos), or with alibi_bf16 (transformers' Falcon) scale * bf16(slope[h] *
// bf16(key_pos)); each is a separate template instantiation (kAlibi), so the default path has no
// extra work in its score loop.
//
// Layouts (the conventions of pagedserve/engine/attention/metadata.py):
//   query, out       [T, H, D]            the step's new tokens, flat over sequences
//   key/value_cache  [NB, BS, Hkv, D]     one layer's cache: query's dtype, bfloat16 or float8_e5m2
//   block_tables     int32 [S, MB]        logical -> physical block of each sequence
//   seq_lens         int32 [S]            context length including the new tokens
//   query_start_loc  int32 [S + 1]        sequence i owns tokens query_start_loc[i]..[i+1]-1, which
//                                         are its last positions; token at position p reads keys 0..p
//   alibi_slopes     float32 [H] or None  per-head ALiBi slopes (alibi_bf16: Falcon's form)
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // vec16.h's F16C / AVX-512 half->float loads, mul_add's FMA
#endif
#include <algorithm>
#include <atomic>
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;  // new tokens per work item (prefill); a decode item has one
constexpr int64_t kKeyTile = 16;    // context positions scored together (any block size)
constexpr int64_t kLanes = 16;      // floats per vector; head_dim must be a multiple
constexpr int64_t kMaxGroup = 4;    // query heads updated together; a larger group is split

#include "vec16.h"  // vf16/vi16, load16, exp_nonpositive, reductions, transpose_sum, round_bf16

enum AlibiMode { kNoAlibi = 0, kRelative = 1, kFalconBf16 = 2 };

#include "work_items.h"  // WorkItem, Upcoming, check_metadata, make_work
#include "key_tiles.h"  // Geometry, for_each_slot, KeyTile, NextTile

#include "online_softmax.h"  // Rows, softmax_step
#include "value_rows.h"  // kValueChunks, paired_chunks, chunk_channel, update_values

// Online-softmax update, with one key tile, of the kG query heads of one token that share a KV head
// (grouped-query attention): rows row0..row0+kG-1, reading that head's K/V at head_offset of each
// slot. Each K and V vector is loaded (and widened from the cache's dtype) once for the kG rows,
// which keeps their scores and outputs in registers. slopes: the kG heads' ALiBi slopes. The next
// tile's prefetches are issued key by key in the score loop, num_rows x 16 (row, key) steps in all: in
// bursts of a share per head group, the core stalled on its fill buffers (1.07-1.13x slower).
template <int kG, int kAlibi, typename kv_t>
void update_heads(Rows& rows, int64_t row0, const KeyTile<kv_t>& tile, int64_t head_offset, int64_t chunks,
                  const float* slopes, float scale, int64_t num_rows) {
  const vf16* q = rows.q.data() + row0 * chunks;
  vf16 partial[kG][kKeyTile];
  for (int64_t j = 0; j < kKeyTile; ++j) {
    vf16 p[kG] = {};
    rows.next.issue(row0 * kKeyTile + (j + 1) * kG);
    if (j < tile.n_valid) {
      const kv_t* key = tile.keys[j] + head_offset;
      int64_t c = 0;
      if constexpr (paired_chunks<kv_t>(4) > 0)
        for (; c < paired_chunks<kv_t>(chunks); c += 2) {
          vf16 even, odd;
          load_pairs(key + c * kLanes, even, odd);
          for (int g = 0; g < kG; ++g) p[g] = mul_add(q[g * chunks + c + 1], odd, mul_add(q[g * chunks + c], even, p[g]));
        }
      for (; c < chunks; ++c) {
        const vf16 k = load16(key + c * kLanes);
        for (int g = 0; g < kG; ++g) p[g] = mul_add(q[g * chunks + c], k, p[g]);
      }
    }
    for (int g = 0; g < kG; ++g) partial[g][j] = p[g];
  }
  float probs[kG][kKeyTile];  // scalars, so the value loop broadcasts them from memory
  float correction[kG];
  for (int g = 0; g < kG; ++g) {
    const vf16 pg = softmax_step<kAlibi>(rows, row0 + g, transpose_sum(partial[g]), tile.n_valid,
                                        kAlibi ? slopes[g] : 0.0f, tile.pos0, scale, correction[g]);
    __builtin_memcpy(probs[g], &pg, sizeof pg);
  }
  vf16* acc = rows.acc.data() + row0 * chunks;
  int64_t c = 0;
  if constexpr (paired_chunks<kv_t>(4) > 0)
    for (; c < paired_chunks<kv_t>(chunks); c += kValueChunks)
      update_values<kG, kValueChunks, kEvenOdd>(acc, chunks, c, tile, head_offset, probs, correction);
  for (; c + kValueChunks <= chunks; c += kValueChunks)
    update_values<kG, kValueChunks, kInOrder>(acc, chunks, c, tile, head_offset, probs, correction);
  for (; c < chunks; ++c) update_values<kG, 1, kInOrder>(acc, chunks, c, tile, head_offset, probs, correction);
}

// update_heads for n (1..kMaxGroup) heads: the instantiation with that many rows in registers.
template <int kAlibi, typename kv_t>
inline void update_head_group(int64_t n, Rows& rows, int64_t row0, const KeyTile<kv_t>& tile, int64_t head_offset,
                              int64_t chunks, const float* slopes, float scale, int64_t num_rows) {
  switch (n) {
    case 1: update_heads<1, kAlibi>(rows, row0, tile, head_offset, chunks, slopes, scale, num_rows); break;
    case 2: update_heads<2, kAlibi>(rows, row0, tile, head_offset, chunks, slopes, scale, num_rows); break;
    case 3: update_heads<3, kAlibi>(rows, row0, tile, head_offset, chunks, slopes, scale, num_rows); break;
    default: update_heads<4, kAlibi>(rows, row0, tile, head_offset, chunks, slopes, scale, num_rows); break;
  }
}

template <typename q_t, typename kv_t, int kAlibi>
void run_item(const WorkItem& w, Rows& rows, const Geometry& g, const q_t* query,
              const kv_t* key_cache, const kv_t* value_cache, const int32_t* block_table,
              int64_t context_len, int64_t seq_token_begin, const float* slopes, q_t* out,
              const Upcoming& upcoming) {
  const int64_t D = g.head_dim, H = g.num_heads, chunks = D / kLanes;
  rows.reset((w.token_end - w.token_begin) * H, chunks);
  for (int64_t t = w.token_begin; t < w.token_end; ++t)  // rows: token-major, then query head
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < chunks; ++c) {  // in the key chunks' channel order
        float channels[kLanes];
        for (int64_t i = 0; i < kLanes; ++i)
          channels[i] = static_cast<float>(query[(t * H + h) * D + chunk_channel<kv_t>(c, i, chunks)]);
        rows.q[((t - w.token_begin) * H + h) * chunks + c] = load16(channels) * g.scale;
      }
  // The token at flat index t reads positions 0..context_len + (t - seq_token_begin).
  const int64_t num_keys = context_len + (w.token_end - seq_token_begin);
  const int64_t slot_stride = g.num_kv_heads * D;
  const int64_t num_rows = (w.token_end - w.token_begin) * H;
  KeyTile<kv_t> tile;
  for (int64_t p0 = 0; p0 < num_keys; p0 += kKeyTile) {
    const int64_t n_tile = std::min(kKeyTile, num_keys - p0);
    for_each_slot(block_table, g, p0, p0 + n_tile, [&](int64_t j, int64_t slot) {
      tile.keys[j] = key_cache + slot * slot_stride;
      tile.values[j] = value_cache + slot * slot_stride;
    });
    if (p0 + kKeyTile < num_keys)
      rows.next.fill(key_cache, value_cache, block_table, g, p0 + kKeyTile, std::min(p0 + 2 * kKeyTile, num_keys),
                     num_rows * kKeyTile);
    else  // the last tile: the first keys of the item this thread will likely take next
      upcoming.first_keys([&](const int32_t* table, int64_t keys) {
        rows.next.fill(key_cache, value_cache, table, g, 0, std::min(kKeyTile, keys), num_rows * kKeyTile);
      });
    for (int64_t t = w.token_begin; t < w.token_end; ++t) {
      tile.n_valid = std::min(n_tile, context_len + (t - seq_token_begin) + 1 - p0);
      if (tile.n_valid <= 0) continue;
      tile.pos0 = static_cast<float>(kAlibi == kRelative ? p0 - (context_len + (t - seq_token_begin)) : p0);
      for (int64_t h = 0; h < H;) {  // groups of up to kMaxGroup heads sharing one KV head
        const int64_t n = std::min(kMaxGroup, g.group - h % g.group);
        const int64_t row = (t - w.token_begin) * H + h;
        update_head_group<kAlibi>(n, rows, row, tile, h / g.group * D, chunks, kAlibi ? slopes + h : nullptr,
                                  g.scale, num_rows);
        h += n;
      }
    }
    rows.next.issue_all();  // the rest, when the tile's last tokens were past their keys
  }
  for (int64_t t = w.token_begin; t < w.token_end; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = (t - w.token_begin) * H + h;
      const float inv = 1.0f / rows.sum[row];
      q_t* dst = out + (t * H + h) * D;
      for (int64_t c = 0; c < chunks; ++c) {
        const vf16 o = rows.acc[row * chunks + c] * inv;
        for (int64_t i = 0; i < kLanes; ++i) dst[chunk_channel<kv_t>(c, i, chunks)] = static_cast<q_t>(o[i]);
      }
    }
  }
}

// The op's tensors, checked (paged_attention), and the ALiBi slopes (nullptr: none).
struct Args {
  const at::Tensor &query, &key_cache, &value_cache, &block_tables, &seq_lens, &query_start_loc;
  at::Tensor& out;
  const float* slopes;
};

// Runs the work items on torch's OpenMP threads (pragmas cannot sit inside the dispatch macro).
template <typename q_t, typename kv_t, int kAlibi>
void run_all(const std::vector<WorkItem>& work, const Geometry& g, const Args& a) {
  const int32_t* qsl = a.query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = a.seq_lens.data_ptr<int32_t>();
  const int32_t* tables = a.block_tables.data_ptr<int32_t>();
  const q_t* q = static_cast<const q_t*>(a.query.data_ptr());
  const kv_t* k = static_cast<const kv_t*>(a.key_cache.data_ptr());
  const kv_t* v = static_cast<const kv_t*>(a.value_cache.data_ptr());
  q_t* o = static_cast<q_t*>(a.out.data_ptr());
  const int64_t n = static_cast<int64_t>(work.size());
  std::atomic<int64_t> claimed{0};  // work items handed out, costliest first
  const Upcoming upcoming{&claimed, work.data(), n, tables, lens, g.max_blocks};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Rows rows;  // per-thread scratch
    for (int64_t i = claimed.fetch_add(1); i < n; i = claimed.fetch_add(1)) {
      const WorkItem& w = work[i];
      const int64_t query_len = qsl[w.seq + 1] - qsl[w.seq];
      run_item<q_t, kv_t, kAlibi>(w, rows, g, q, k, v, tables + w.seq * g.max_blocks, lens[w.seq] - query_len,
                                  qsl[w.seq], a.slopes, o, upcoming);
    }
  }
}

// The instantiation for the query type q_t, the caches' element type and the ALiBi form (each branch
// taken once per call, outside every loop; paged_attention has checked the cache dtype).
template <typename q_t>
void dispatch_cache(const std::vector<WorkItem>& work, const Geometry& g, const Args& a, bool alibi_bf16) {
  const at::ScalarType kv = a.key_cache.scalar_type();
  auto with_alibi = [&](auto kv_zero) {
    using kv_t = decltype(kv_zero);
    if (a.slopes == nullptr) run_all<q_t, kv_t, kNoAlibi>(work, g, a);
    else if (alibi_bf16) run_all<q_t, kv_t, kFalconBf16>(work, g, a);
    else run_all<q_t, kv_t, kRelative>(work, g, a);
  };
  if (kv == a.query.scalar_type()) with_alibi(q_t{});
  else if (kv == at::kBFloat16) with_alibi(c10::BFloat16{});
  else with_alibi(c10::Float8_e5m2{});
}

// out[T, H, D] = causal paged attention of query[T, H, D] over each sequence's cached context.
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     const c10::optional<at::Tensor>& alibi_slopes, bool alibi_bf16) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "query must be [T, H, D] and the caches [NB, BS, Hkv, D]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must match query");
  const at::ScalarType kv = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == kv && (kv == query.scalar_type() || kv == at::kBFloat16 ||
                                                   kv == at::kFloat8_e5m2),
              "the caches must share one dtype: the query's, bfloat16 or float8_e5m2; got ", kv, " and ",
              value_cache.scalar_type(), " with a ", query.scalar_type(), " query");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "every tensor must be contiguous on the CPU");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kInt, "block_tables, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0) &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1, "one block-table row and length per sequence");
  const Geometry g{query.size(1), key_cache.size(2), query.size(1) / key_cache.size(2), query.size(2),
                   key_cache.size(1), block_tables.size(1), static_cast<float>(scale)};
  TORCH_CHECK(g.num_heads % g.num_kv_heads == 0 && key_cache.size(3) == g.head_dim && g.head_dim % kLanes == 0,
              "heads must be a multiple of KV heads, head_dim must match and be a multiple of 16");
  check_metadata(block_tables, seq_lens, query_start_loc, query.size(0), key_cache.size(0), g.block_size);
  const float* slopes = nullptr;
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    TORCH_CHECK(a.dim() == 1 && a.size(0) == g.num_heads && a.scalar_type() == at::kFloat && a.is_contiguous() &&
                    a.device().is_cpu(), "alibi_slopes must be contiguous float32 [num_heads] on the CPU");
    slopes = a.data_ptr<float>();
  }
  const std::vector<WorkItem> work = make_work(seq_lens, query_start_loc);
  const Args args{query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, slopes};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_cpu", [&] {
    dispatch_cache<scalar_t>(work, g, args, alibi_bf16);
  });
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "Tensor? alibi_slopes=None, bool alibi_bf16=False) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("paged_attention", TORCH_FN(paged_attention)); }
