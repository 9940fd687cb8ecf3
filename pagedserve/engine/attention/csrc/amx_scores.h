// A key tile's attention scores by AMX for the CPU paged-attention op (paged_attention_cpu.cpp includes
// this inside its anonymous namespace, after kKeyTile, kMaxGroup and vec16.h). Part of the op's build:
// cpu_op.py hashes every header in this folder with the source.
//
// With a bfloat16 query over bfloat16 K, the scores of one token's query heads that share a KV head are a
// small matrix product: S[16 keys, 4 heads] = K[16 keys, D] . Q[D, 4 heads]. One AMX TDPBF16PS (Intel
// SDM, "Intel AMX"; C += A . B with A 16 x 32 bfloat16, B 16 x N pairs of bfloat16 in the "VNNI" layout,
// products exact and summed into float32, denormals flushed) per 32 channels replaces, per key tile and
// head group, 16 x D/16 widening loads, 3 x 16 x D/16 FMAs and three 16-vector transposing sums. The
// key tile is one block's 16 slots (block size a multiple of 16), so A is loaded straight from the cache
// with the slot stride; B, the query rows as pairs, is built once per work item (QueryPairs).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

constexpr bool kHaveAmx = true;

// Whether Linux lets this process use the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, asked once; Linux >= 5.16). Without it a tile instruction would kill the process.
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

// Loads amx_scores' tile shapes on the calling thread (other AMX users, oneDNN's GEMMs, load their own
// before each use): tmm0 = S, 16 keys x kMaxGroup float32; tmm1 = 32 channels of 16 keys, bfloat16;
// tmm2 = 16 channel pairs x kMaxGroup heads.
inline void configure_tiles() {
  struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config{};
  config.palette_id = 1;
  config.rows[0] = kKeyTile, config.colsb[0] = 4 * kMaxGroup;
  config.rows[1] = kKeyTile, config.colsb[1] = 64;
  config.rows[2] = 16, config.colsb[2] = 4 * kMaxGroup;
  _tile_loadconfig(&config);
}

inline void release_tiles() { _tile_release(); }

// The query rows of a work item as TDPBF16PS's B operand: pairs[(c * 16 + r) * stride + row] holds channels
// 32c + 2r and 32c + 2r + 1 of query row `row` (one 32-bit word), so the kMaxGroup rows from row0 are
// one 16 x kMaxGroup tile at &pairs[c * 16 * stride + row0] with a row stride of `stride` words.
// kMaxGroup zero rows of padding keep the last group's load inside the buffer.
struct QueryPairs {
  std::vector<uint32_t> pairs;
  int64_t stride = 0;
  void reset(int64_t rows, int64_t head_dim) {
    stride = rows + kMaxGroup;
    pairs.assign(head_dim / 32 * 16 * stride, 0);
  }
  void set_row(int64_t row, const c10::BFloat16* q, int64_t head_dim) {  // pair i = 16c + r
    for (int64_t i = 0; i < head_dim / 2; ++i) __builtin_memcpy(&pairs[i * stride + row], q + 2 * i, 4);
  }
};

// scores[g][j] = q_{row0+g} . k_j for the tile's 16 keys j (key 0 at key0, the next at + slot_stride
// elements) and the kMaxGroup query rows from row0 (those past the group are other heads' or padding,
// and ignored). Lanes of keys past the sequence hold whatever the block's unused slots give.
inline void amx_scores(const QueryPairs& q, int64_t row0, const c10::BFloat16* key0, int64_t slot_stride,
                       int64_t head_dim, vf16 scores[kMaxGroup]) {
  _tile_zero(0);
  for (int64_t c = 0; c < head_dim / 32; ++c) {
    _tile_loadd(1, key0 + 32 * c, slot_stride * 2);
    _tile_loadd(2, q.pairs.data() + c * 16 * q.stride + row0, q.stride * 4);
    _tile_dpbf16ps(0, 1, 2);
  }
  alignas(64) float s[kKeyTile * kMaxGroup];  // [key][head]
  _tile_stored(0, s, 4 * kMaxGroup);
  static_assert(kMaxGroup == 4 && kKeyTile == 16, "the de-interleave below takes 4 heads of 16 keys");
  const __m512 v0 = _mm512_load_ps(s), v1 = _mm512_load_ps(s + 16), v2 = _mm512_load_ps(s + 32),
               v3 = _mm512_load_ps(s + 48);
  const __m512i every_fourth = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  for (int g = 0; g < kMaxGroup; ++g) {
    const __m512i idx = _mm512_add_epi32(every_fourth, _mm512_set1_epi32(g));
    const __m512 lo = _mm512_permutex2var_ps(v0, idx, v1);  // keys 0..7 in lanes 0..7
    const __m512 hi = _mm512_permutex2var_ps(v2, idx, v3);  // keys 8..15 in lanes 0..7
    const __m512 keys = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
    __builtin_memcpy(&scores[g], &keys, sizeof keys);
  }
}
#else
constexpr bool kHaveAmx = false;
inline bool amx_permitted() { return false; }
inline void configure_tiles() {}
inline void release_tiles() {}
struct QueryPairs {
  int64_t stride = 0;
  void reset(int64_t, int64_t) {}
  void set_row(int64_t, const c10::BFloat16*, int64_t) {}
};
inline void amx_scores(const QueryPairs&, int64_t, const c10::BFloat16*, int64_t, int64_t, vf16*) {}  // never chosen
#endif
