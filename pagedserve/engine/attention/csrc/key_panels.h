// Packing a KV head's keys into panels of 16 keys, d-major, for the CPU prefill attention op
// (prefill_attention_cpu.cpp includes this inside its anonymous namespace, after Shape, kCols and
// kv_rows.h). Part of the op's build: cpu_op.py hashes every header in this folder with the source.
#pragma once

// dst[i * dst_stride + j] = rows[j][d0 + i] for i, j in 0..7: an 8 x 8 transpose in registers (unpack
// pairs, shuffle quads, swap 128-bit lanes). A copy: the same bits as an element-by-element loop, which
// cost the op a quarter of its time on a 16-token chunk after 400 cached tokens.
inline void transpose8(const float* const* rows, int64_t d0, float* dst, int64_t dst_stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + d0);
  for (int i = 0; i < 8; i += 2)
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// Panel hp = h * P + p of K (P panels a head): panels[hp][d][j] = key[16p + j, h, d], 0 for keys past L.
// Writes every float of the panel (the buffer need not be zeroed). Needs D a multiple of 8.
void pack_panel(const KvRows& kv, const Shape& s, int64_t hp, float* panels) {
  const int64_t P = s.panels_per_head(), h = hp / P, p = hp % P, keys = std::min(kCols, s.L - p * kCols);
  float* dst = panels + hp * s.D * kCols;
  for (int64_t j0 = 0; j0 < kCols; j0 += 8) {
    const float* rows[8];
    for (int64_t j = 0; j < 8; ++j)
      rows[j] = j0 + j < keys ? kv.key[p * kCols + j0 + j] + h * kv.key_head_stride : nullptr;
    if (j0 + 8 <= keys) {
      for (int64_t d0 = 0; d0 < s.D; d0 += 8) transpose8(rows, d0, dst + d0 * kCols + j0, kCols);
      continue;
    }
    for (int64_t j = 0; j < 8; ++j)  // the last panel's keys past L
      for (int64_t d = 0; d < s.D; ++d) dst[d * kCols + j0 + j] = rows[j] ? rows[j][d] : 0.0f;
  }
}
