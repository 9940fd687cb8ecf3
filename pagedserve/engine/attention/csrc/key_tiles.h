// Walking a sequence's context through its block table, a key tile at a time, for the CPU
// paged-attention op (paged_attention_cpu.cpp includes this inside its anonymous namespace, after
// kKeyTile). Part of the op's build: cpu_op.py hashes every header in this folder with the source.
#pragma once

struct Geometry {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  float scale;
};

// Calls visit(j, slot) with the cache slot of each context position begin + j < end of a sequence,
// through its block table: one division for the first position, then a walk along the blocks (a
// division per position cost the op a sixth of its time).
template <typename Visit>
inline void for_each_slot(const int32_t* block_table, const Geometry& g, int64_t begin, int64_t end, Visit visit) {
  int64_t block = begin / g.block_size, offset = begin % g.block_size;
  for (int64_t pos = begin; pos < end; ++pos) {
    visit(pos - begin, block_table[block] * g.block_size + offset);
    if (++offset == g.block_size) offset = 0, ++block;
  }
}

// Where NextTile prefetches K lines: L1, or L2 with PAGEDSERVE_PREFETCH_TO_L2 (see NextTile::issue).
#if defined(PAGEDSERVE_PREFETCH_TO_L2)
constexpr int kKeyLocality = 2;  // prefetcht1: into L2
#else
constexpr int kKeyLocality = 3;  // prefetcht0: into L1
#endif

// The cache lines of the next key tile's K/V slots, prefetched a share at a time while the current
// tile's rows are updated: one burst of all of them (384 lines for a float32 tile of 3 KV heads of
// 64) stalled on the CPU's few fill buffers, and the op read float32 K/V at 47-51% of the streaming
// bandwidth instead of 65-76% (Intel Xeon with AMX, 2 threads; docs/benchmarks.md). The tile keeps its
// slots' addresses and walks their lines with two counters: a list of every line's address, written
// per tile, cost a tenth of the op's time (float32 1.10-1.12x faster without it, same outputs).
struct NextTile {
  const char* key_slots[kKeyTile];
  const char* value_slots[kKeyTile];
  int64_t lines_per_slot = 0, total = 0, issued = 0;
  int64_t slot = 0, line = 0;  // the next line to prefetch: K's, then V's (issued odd)
  uint64_t lines_per_row = 0;  // total / rows in 32.32 fixed point, rounded up (one division per tile)

  // Positions begin..end-1, all KV heads, to be issued over `rows` (row, key) steps (issue's `done`).
  template <typename kv_t>
  void fill(const kv_t* key_cache, const kv_t* value_cache, const int32_t* block_table, const Geometry& g,
            int64_t begin, int64_t end, int64_t rows) {
    const int64_t slot_bytes = g.num_kv_heads * g.head_dim * static_cast<int64_t>(sizeof(kv_t));
    lines_per_slot = (slot_bytes + 63) / 64;
    total = 2 * std::max<int64_t>(end - begin, 0) * lines_per_slot;
    issued = slot = line = 0;
    lines_per_row = (static_cast<uint64_t>(total) << 32) / static_cast<uint64_t>(rows) + 1;
    for_each_slot(block_table, g, begin, end, [&](int64_t j, int64_t slot) {
      key_slots[j] = reinterpret_cast<const char*>(key_cache) + slot * slot_bytes;
      value_slots[j] = reinterpret_cast<const char*>(value_cache) + slot * slot_bytes;
    });
  }

  // Prefetches up to the share `done / rows` of the lines, slot by slot, each line of K then of V: K
  // into L1 (kKeyLocality), V into L2 (a float32 tile's K and V, 24 KiB for 3 KV heads of 64, and the
  // next tile's would not fit Zen 3's 32 KiB L1D; float32 1.05-1.06x at 256 x 270 on the AVX2 EPYC, 1.02x
  // at 64 x 270, bfloat16 and fp8 1.01x; every line into L2 was 0.98x / 0.84x for float32 / fp8). Built
  // with PAGEDSERVE_PREFETCH_TO_L2 (cpu_features.l2_prefetches_preferred: AMD with AVX-512), K goes into L2
  // too: on a Zen 4 EPYC 1.3-1.6x for float32 and bfloat16 K/V from DRAM (into L1 the prefetches held
  // the op at half the streaming read; `scripts/attention_op_ab.py`, docs/benchmarks.md). The share
  // is a multiplication by lines_per_row, the counters are locals in the loop: a 64-bit division per
  // call (48 per float32 tile) and counters kept in memory were 1.01-1.06x slower (AVX2 EPYC, float32).
  void issue(int64_t done) {
    issue_until(std::min<int64_t>(total, static_cast<int64_t>((static_cast<uint64_t>(done) * lines_per_row) >> 32)));
  }
  void issue_all() { issue_until(total); }  // the rest, when the tile's last tokens were past their keys

  void issue_until(int64_t until) {
    int64_t i = issued, s = slot, l = line;
    for (; i < until; ++i) {
      if (i & 1) {
        __builtin_prefetch(value_slots[s] + l * 64, 0, 2);
        if (++l == lines_per_slot) l = 0, ++s;
      } else {
        __builtin_prefetch(key_slots[s] + l * 64, 0, kKeyLocality);
      }
    }
    issued = i, slot = s, line = l;
  }
};

// A key tile's slots (keys[j] / values[j]: slot j's first KV head) and where a token's keys stop in it.
template <typename kv_t>
struct KeyTile {
  const kv_t* keys[kKeyTile];
  const kv_t* values[kKeyTile];
  int64_t n_valid;  // the token reads keys 0..n_valid-1 of the tile
  float pos0;       // ALiBi: kRelative, key 0's distance from the query (<= 0); kFalconBf16, its position
};
