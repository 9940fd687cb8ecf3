// The CPU paged-attention op's work items: one sequence's tile of up to kQueryTile new tokens with all
// its heads, handed to threads costliest first (paged_attention_cpu.cpp includes this inside its
// anonymous namespace, after kQueryTile). Part of the op's build: cpu_op.py hashes every header in this
// folder with the source.
#pragma once

struct WorkItem {  // all heads of up to kQueryTile new tokens of one sequence
  int64_t seq;
  int64_t token_begin;  // first token of the tile in the flat batch
  int64_t token_end;
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
  void first_keys(Use use) const {  // use(block table, context length), if an item is left
    const int64_t next = claimed->load(std::memory_order_relaxed);
    if (next < n) use(tables + work[next].seq * max_blocks, lens[work[next].seq]);
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

std::vector<WorkItem> make_work(const at::Tensor& seq_lens, const at::Tensor& query_start_loc) {
  const int64_t S = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<WorkItem> work;
  for (int64_t i = 0; i < S; ++i) {
    for (int64_t t = qsl[i]; t < qsl[i + 1]; t += kQueryTile) {
      const int64_t end = std::min<int64_t>(t + kQueryTile, qsl[i + 1]);
      const int64_t keys = lens[i] - (qsl[i + 1] - end);  // keys read by the tile's last token
      work.push_back({i, t, end, (end - t) * keys});
    }
  }
  std::stable_sort(work.begin(), work.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return work;
}
