// y = x @ W^T + bias for a few rows of bfloat16 activations: AVX512_BF16 dot products over a weight
// packed once, near the memory bandwidth where oneDNN's kernels for 1-8 rows read the weights at about
// half of it (`pagedserve bench gemm-rows`; docs/benchmarks.md, "The attention op regrouped, and
// few-row bfloat16 GEMMs").
//
// vdpbf16ps (Intel SDM, VDPBF16PS) multiplies 16 pairs of bfloat16 and adds each pair's two products
// to one float32 lane. The packed weight puts in each 64-byte line the pairs (k, k + 1) of 16
// consecutive output columns, so that a line times one broadcast pair of x adds to the 16 columns'
// sums at once: no horizontal sums, and the weight is read once, in order, for up to kRowTile rows.
// Each row's sums run over k in the same order whatever the other rows, so a row's result does not
// depend on how many rows the call has (unlike oneDNN's, which pads one row to two). Products of
// bfloat16 are exact in float32; the sums are float32 (the instruction flushes denormal inputs and
// outputs to zero, rounds to nearest even); the result is rounded to bfloat16 once, bias added first.
//
// Layouts:
//   weight  bfloat16 [N, K]                    N a multiple of 16, K even (pack_pairs checks)
//   packed  bfloat16 [N / 16, K / 2, 16, 2]    pack_pairs(weight)
//   x       bfloat16 [M, K] contiguous,  bias float32 [N] or None,  out bfloat16 [M, N]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "l2_prefetch.h"  // prefetch_ahead_to_l2

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kCols = 16;      // output columns of one packed block (one vector of sums)
constexpr int64_t kRowTile = 4;    // rows of x per pass over a weight block
constexpr int64_t kBlockTile = 4;  // weight blocks per pass: kRowTile x kBlockTile sums in registers


at::Tensor pack_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "weight must be bfloat16 [N, K] on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kCols == 0 && K % 2 == 0, "weight [N, K] needs N a multiple of 16 and K even, got [", N, ", ", K, "]");
  return weight.contiguous().view({N / kCols, kCols, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// sums[r][b] = rows r of x times weight blocks b (kRows x kBlocks vectors of 16 float32 sums).
template <int kRows, int kBlocks>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t block_stride, float* sums) {
  __m512 acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512i wv[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
#if defined(PAGEDSERVE_PREFETCH_TO_L2)  // Zen 4: 1.05-1.14x at 1 row (scripts/few_rows_ab.py)
      prefetch_ahead_to_l2(w + b * block_stride + kp * 2 * kCols);
#endif
      wv[b] = _mm512_loadu_si512(w + b * block_stride + kp * 2 * kCols);
    }
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, x + r * K + 2 * kp, sizeof pair);
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xv, (__m512bh)wv[b]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) _mm512_storeu_ps(sums + (r * kBlocks + b) * kCols, acc[r][b]);
}

template <int kRows>
inline void tile_blocks(int64_t blocks, const uint16_t* x, int64_t K, const uint16_t* w, int64_t stride, float* sums) {
  switch (blocks) {
    case 1: tile<kRows, 1>(x, K, w, stride, sums); break;
    case 2: tile<kRows, 2>(x, K, w, stride, sums); break;
    case 3: tile<kRows, 3>(x, K, w, stride, sums); break;
    default: tile<kRows, 4>(x, K, w, stride, sums); break;
  }
}

inline void tile_rows(int64_t rows, int64_t blocks, const uint16_t* x, int64_t K, const uint16_t* w, int64_t stride,
                      float* sums) {
  switch (rows) {
    case 1: tile_blocks<1>(blocks, x, K, w, stride, sums); break;
    case 2: tile_blocks<2>(blocks, x, K, w, stride, sums); break;
    case 3: tile_blocks<3>(blocks, x, K, w, stride, sums); break;
    default: tile_blocks<4>(blocks, x, K, w, stride, sums); break;
  }
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
              "x must be contiguous bfloat16 [M, K] on the CPU");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) * 2 == x.size(1) && packed.size(2) == kCols && packed.size(3) == 2,
              "packed must be pack_pairs of a [N, ", x.size(1), "] weight");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * kCols;
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be contiguous float32 [", N, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t stride = K * kCols;  // elements of one packed block
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {  // each thread its own output columns
    float sums[kRowTile * kBlockTile * kCols];
    for (int64_t blk = b0; blk < b1; blk += kBlockTile) {
      const int64_t nb = std::min(kBlockTile, b1 - blk);
      for (int64_t r = 0; r < M; r += kRowTile) {
        const int64_t nr = std::min(kRowTile, M - r);
        tile_rows(nr, nb, xp + r * K, K, wp + blk * stride, stride, sums);
        for (int64_t i = 0; i < nr; ++i)
          for (int64_t j = 0; j < nb; ++j) {
            __m512 v = _mm512_loadu_ps(sums + (i * nb + j) * kCols);
            if (b != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(b + (blk + j) * kCols));
            const __m256bh rounded = _mm512_cvtneps_pbh(v);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + (r + i) * N + (blk + j) * kCols), (__m256i)rounded);
          }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve_gemm, m) {
  m.def("pack_pairs(Tensor weight) -> Tensor");
  m.def("few_rows_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_gemm, CPU, m) {
  m.impl("pack_pairs", TORCH_FN(pack_pairs));
  m.impl("few_rows_linear", TORCH_FN(few_rows_linear));
}
