// The value half of a key tile's update for the CPU paged-attention op (paged_attention_cpu.cpp includes
// this inside its anonymous namespace, after vec16.h and key_tiles.h): each query row's output gains
// the tile's values weighted by its probabilities. Part of the op's build: cpu_op.py hashes every
// header in this folder with the source.
#pragma once

// Output chunks per update_values (the rest one at a time): kG x kValueChunks sums stay in registers, 12
// for a group of 3 at 4 chunks on AVX-512; on AVX2 (a vf16 in two of its 16 registers) 2 chunks.
constexpr int64_t kValueChunks = 4 / kRegistersPerVf16;

// How many of a row's `chunks` 16-channel chunks are paired: for a bfloat16 cache, the chunks below the
// last multiple of 4 hold 32 channels as two chunks, their even and their odd channels (load_pairs: one
// load, a shift and a mask per 32 channels where widening took two loads, two widenings and two
// shifts); for other caches none. The same on every CPU (kValueChunks divides 4), so a score sums its
// products in the same order everywhere. Queries and outputs use the same order (chunk_channel): a
// score sums the same products as in channel order, in another order.
template <typename kv_t>
constexpr int64_t paired_chunks(int64_t chunks) {
  return std::is_same_v<kv_t, c10::BFloat16> ? chunks / 4 * 4 : 0;
}
static_assert(4 % kValueChunks == 0, "a group of kValueChunks chunks must be all paired or all unpaired");

// Which order update_values reads a chunk group's channels in: as they are, or (paired bfloat16
// chunks) the even channels, then the odd ones.
enum ChunkOrder { kInOrder, kEvenOdd };

// The channel held by lane i of chunk c of a row of `chunks` chunks.
template <typename kv_t>
inline int64_t chunk_channel(int64_t c, int64_t i, int64_t chunks) {
  return c < paired_chunks<kv_t>(chunks) ? c / 2 * 2 * kLanes + 2 * i + c % 2 : c * kLanes + i;
}

// The kG rows' outputs, channels c0 .. c0 + kC * 16 - 1: acc = acc * correction + sum over the tile's keys
// j of probs[j] * v_j, each element summed in key order. The kC x kG sums stay in registers across the
// keys: kC = 4 gives 12 independent FMA chains for a group of 3 heads, where one chunk at a time gave 3,
// each a chain of 16 dependent FMAs (the value loop was bound by FMA latency, not by its loads).
template <int kG, int kC, ChunkOrder kOrder, typename kv_t>
inline void update_values(vf16* acc, int64_t chunks, int64_t c0, const KeyTile<kv_t>& tile, int64_t head_offset,
                          const float probs[kG][kKeyTile], const float correction[kG]) {
  vf16 a[kG][kC];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) a[g][c] = acc[g * chunks + c0 + c] * correction[g];
  for (int64_t j = 0; j < tile.n_valid; ++j)
    if constexpr (kOrder == kEvenOdd)
      for (int c = 0; c < kC; c += 2) {
        vf16 even, odd;
        load_pairs(tile.values[j] + head_offset + (c0 + c) * kLanes, even, odd);
        for (int g = 0; g < kG; ++g) {
          const vf16 p = splat(probs[g][j]);
          a[g][c] = mul_add(p, even, a[g][c]), a[g][c + 1] = mul_add(p, odd, a[g][c + 1]);
        }
      }
    else
      for (int c = 0; c < kC; ++c) {
        const vf16 v = load16(tile.values[j] + head_offset + (c0 + c) * kLanes);
        for (int g = 0; g < kG; ++g) a[g][c] = mul_add(splat(probs[g][j]), v, a[g][c]);
      }
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) acc[g * chunks + c0 + c] = a[g][c];
}
