// Packing a float32 weight [N, K] into the panel GEMM's panels [ceil(N / 16), K, 16] (panel_gemm_f32.cpp
// includes this inside its anonymous namespace, after kCols; the layout is in its header comment). Part of
// the kernel's build: cpu_op.py hashes every header in this folder with the source.
#pragma once

// The 8 x 8 transpose of rows r[0..7] (8 floats each): r[i] becomes column i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20), r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
}

// Panel p, rows k0..k0+7, from the weight's rows `rows` (16 pointers; a missing column's row is zeros):
// two 8 x 8 transposes, then each k's 16 values as one 64-byte line.
inline void pack_block8(const float* const rows[kCols], int64_t k0, float* panel) {
  __m256 lo[8], hi[8];
  for (int i = 0; i < 8; ++i) lo[i] = _mm256_loadu_ps(rows[i] + k0), hi[i] = _mm256_loadu_ps(rows[i + 8] + k0);
  transpose8(lo);
  transpose8(hi);
  for (int i = 0; i < 8; ++i) {
    _mm256_storeu_ps(panel + (k0 + i) * kCols, lo[i]);
    _mm256_storeu_ps(panel + (k0 + i) * kCols + 8, hi[i]);
  }
}

void pack_panels(const at::Tensor& weight, at::Tensor& panels) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "weight must be float32 [N, K] on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kCols - 1) / kCols;
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.device().is_cpu() && panels.size(0) == P && panels.size(1) == K && panels.size(2) == kCols,
              "panels must be a contiguous float32 [", P, ", ", K, ", ", kCols, "] tensor on the CPU for a [", N, ", ",
              K, "] weight");
  const at::Tensor w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  const std::vector<float> zeros(K, 0.0f);  // the rows of the last panel's missing columns
  // 8 x 16 blocks transposed in registers, each panel line written whole: 0.20 s for the default
  // model's GEMMs on one thread of the AVX2 EPYC, where a column-by-column copy (16 strided writes to
  // each line) took 0.25-0.30 s; a process's first pack takes 0.3-1.1 s more, the first touch of pages
  // it never used before (streaming stores gained 0.03 s: not kept).
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* rows[kCols];
      for (int64_t c = 0; c < kCols; ++c) rows[c] = p * kCols + c < N ? src + (p * kCols + c) * K : zeros.data();
      float* panel = dst + p * K * kCols;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) pack_block8(rows, k, panel);
      for (; k < K; ++k)
        for (int64_t c = 0; c < kCols; ++c) panel[k * kCols + c] = rows[c][k];
    }
  });
}
