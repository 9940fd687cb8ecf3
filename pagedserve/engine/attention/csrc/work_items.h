// The CPU paged-attention op's work items: one sequence's tile of up to kQueryTile new tokens with all
// its heads (or, when there are fewer tiles than threads, a share of its KV heads), handed to threads
// costliest first (paged_attention_cpu.cpp includes this inside its anonymous namespace, after
// kQueryTile). Part of the op's build: cpu_op.py hashes every header in this folder with the source.
#pragma once

struct WorkItem {  // the query heads of KV heads kv_begin..kv_end-1 of up to kQueryTile new tokens of one sequence
  int64_t seq;
  int64_t token_begin;  // first token of the tile in the flat batch
  int64_t token_end;
  int64_t kv_begin, kv_end;
  int64_t cost;         // query rows x keys read, for longest-first scheduling
};

// The next work item not yet taken: the thread finishing an item will likely take it, so the item's last
// tile prefetches its first keys (else every item began on cache misses; 1.06x for bfloat16 K/V).
struct Upcoming {
  const std::atomic<int64_t>* claimed;
  const WorkItem* work;
  int64_t n;
  const int32_t *tables, *lens;
  int64_t max_blocks;
  template <typename Use>
  void first_keys(Use use) const {  // use(its item, block table, context length), if an item is left
    const int64_t next = claimed->load(std::memory_order_relaxed);
    if (next < n) use(work[next], tables + work[next].seq * max_blocks, lens[work[next].seq]);
  }
};

// Checks the per-sequence metadata against the cache before any thread reads through it.
void check_metadata(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const at::Tensor& query_start_loc, int64_t num_tokens, int64_t num_blocks,
                    int64_t block_size) {
  const int64_t S = seq_lens.size(0), MB = block_tables.size(1);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[S] == num_tokens, "query_start_loc must run from 0 to num_tokens");
  for (int64_t i = 0; i < S; ++i) {
    const int64_t q = qsl[i + 1] - qsl[i];
    TORCH_CHECK(q >= 1 && q <= lens[i], "sequence ", i, ": query length ", q, " not in 1..seq_len ", lens[i]);
    const int64_t needed = (lens[i] + block_size - 1) / block_size;
    TORCH_CHECK(needed <= MB, "sequence ", i, " needs ", needed, " blocks, block table has ", MB);
    for (int64_t b = 0; b < needed; ++b)
      TORCH_CHECK(bt[i * MB + b] >= 0 && bt[i * MB + b] < num_blocks, "sequence ", i,
                  ": block id ", bt[i * MB + b], " outside the cache of ", num_blocks, " blocks");
  }
}

// The tiles of every sequence, each with all KV heads; when there are fewer tiles than `threads` (a batch
// of one decode on two threads), each tile's KV heads split into up to threads / tiles shares, so that no
// thread idles: a head's scores and outputs do not depend on the others', so the bits are the same.
std::vector<WorkItem> make_work(const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_kv_heads,
                                int64_t threads) {
  const int64_t S = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t tiles = 0;
  for (int64_t i = 0; i < S; ++i) tiles += (qsl[i + 1] - qsl[i] + kQueryTile - 1) / kQueryTile;
  const int64_t shares = tiles == 0 ? 1 : std::clamp<int64_t>((threads + tiles - 1) / tiles, 1, num_kv_heads);
  std::vector<WorkItem> work;
  for (int64_t i = 0; i < S; ++i) {
    for (int64_t t = qsl[i]; t < qsl[i + 1]; t += kQueryTile) {
      const int64_t end = std::min<int64_t>(t + kQueryTile, qsl[i + 1]);
      const int64_t keys = lens[i] - (qsl[i + 1] - end);  // keys read by the tile's last token
      for (int64_t s = 0; s < shares; ++s) {
        const int64_t kv_begin = s * num_kv_heads / shares, kv_end = (s + 1) * num_kv_heads / shares;
        work.push_back({i, t, end, kv_begin, kv_end, (end - t) * keys * (kv_end - kv_begin)});
      }
    }
  }
  std::stable_sort(work.begin(), work.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return work;
}
