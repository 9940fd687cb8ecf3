// The online softmax of the CPU paged-attention op (paged_attention_cpu.cpp includes this inside its
// anonymous namespace, after vec16.h, key_tiles.h and AlibiMode): a work item's rows and the update of one
// row's running maximum and sum by a key tile's scores (FlashAttention, Dao et al., NeurIPS 2022, §3.1,
// Algorithm 1). Part of the op's build: cpu_op.py hashes every header in this folder with the source.
#pragma once

// One work item's rows: scaled queries, running max and sum, unnormalised outputs.
struct Rows {
  std::vector<vf16> q, acc;  // [rows, D / 16] each, channels in chunk_channel's order
  std::vector<float> max, sum;
  NextTile next;             // the next key tile's cache lines, prefetched over this tile's rows
  void reset(int64_t rows, int64_t chunks) {
    q.assign(rows * chunks, vf16{});
    acc.assign(rows * chunks, vf16{});
    max.assign(rows, -std::numeric_limits<float>::infinity());
    sum.assign(rows, 0.0f);
  }
};

// The online-softmax step of row `row` given its 16 scores (lanes >= n_valid are masked here): updates
// the row's max and sum and returns the tile's probabilities; `correction` rescales its old outputs.
// kRelative: key j of the tile is pos0 + j positions from the query (<= 0), its bias slope * that;
// kFalconBf16: key j is at position pos0 + j, its bias bias_scale * bf16(slope * bf16(position)).
template <int kAlibi>
inline vf16 softmax_step(Rows& rows, int64_t row, vf16 scores, int64_t n_valid, float slope, float pos0,
                         float bias_scale, float& correction) {
  if constexpr (kAlibi == kRelative) scores += slope * (to_float(lane_index()) + pos0);
  if constexpr (kAlibi == kFalconBf16) scores += round_bf16(slope * round_bf16(to_float(lane_index()) + pos0)) * bias_scale;
  scores = first_lanes(scores, n_valid, -std::numeric_limits<float>::infinity());
  const float old_max = rows.max[row];
  const float new_max = std::max(old_max, reduce_max(scores));
  correction = new_max == old_max ? 1.0f : std::exp(old_max - new_max);  // 0 on the first tile
  const vf16 probs = exp_nonpositive(scores - new_max);
  rows.sum[row] = rows.sum[row] * correction + reduce_sum(probs);
  rows.max[row] = new_max;
  return probs;
}
