// y = x @ W^T + bias in float32 on CPUs with AVX2 and FMA (and AVX-512), over a weight packed once into
// panels of 16 output columns: a register-blocked GEMM in the manner of BLIS (Van Zee & van de Geijn, "BLIS:
// A Framework for Rapidly Instantiating BLAS Functionality", ACM TOMS 2015; Goto & van de Geijn, "Anatomy of
// High-Performance Matrix Multiplication", ACM TOMS 2008). With AVX2, a 6 x 16 block of sums in 12 ymm
// registers: per k, two loads of the panel and 6 broadcasts of x for 12 fused multiply-adds. With AVX-512, a
// 6 x 64 block (4 panels side by side) in 24 zmm registers: per k, four loads and 6 broadcasts for 24. A k
// slice of up to kKc is summed while x's rows (up to kXBytes of them) pass over it.
//
// Each output element is sum_k x[m, k] * W[n, k] over k = 0, 1, ..., K - 1 in that order (one fused
// multiply-add per k, from 0), then + bias[n]. The order depends on nothing but K: not on how many rows
// the call has, which rows share a block, how many threads split the columns, or whether the build has
// AVX-512. So a row's result is the same bits alone as in a batch of any size (oneDNN pads one row to
// two for that; MKL's rows change with the batch: scripts/gemm_batch_invariance.py), and the same on an
// AVX2 and an AVX-512 CPU.
//
// Layouts:
//   weight  float32 [N, K]
//   panels  float32 [ceil(N / 16), K, 16]   pack_panels(weight, panels): panel p, row k = W[16p .. 16p + 15, k]
//                                            (columns past N: 0; their sums are computed, not stored)
//   x       float32 [M, K] contiguous,  bias float32 [N] or None,  out float32 [M, N]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "l2_prefetch.h"  // prefetch_ahead_to_l2 (the AVX-512 block's panels)

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kCols = 16;   // output columns of a panel: one 16-float line per k
constexpr int64_t kRows = 6;    // rows of a register block
#if defined(__AVX512F__)
// panels of a register block: 6 x 4 sums (a zmm each) + 4 panel lines + 1 broadcast = 29 of 32 registers,
// each broadcast of x feeding 4 fused multiply-adds (the blockings tried: docs/benchmarks.md, "The panel
// GEMM on AVX-512").
constexpr int64_t kPanels = 4;
#else
constexpr int64_t kPanels = 1;  // 6 x 2 sums (two ymm halves each) + 2 panel loads + 1 broadcast = 15 of 16
#endif
// k per pass: a panel's slice is up to 256 x 16 x 4 B = 16 KiB, half of L1D (AVX2); a block's 4 slices with
// AVX-512, up to 64 KiB, are read from L2 (slices of 128 and 192 k, which fit Zen 4's 32 KiB L1D better, ran
// 0.96-1.00x as fast).
constexpr int64_t kKc = 256;
// x's rows per pass over the panels: up to 4 MiB of x, one pass for any decode batch of the default model.
// Each pass streams every panel from memory again; with passes of x that fit L2 (256 KiB) the model's
// GEMMs were 1.07x / 1.16x slower at 160 / 256 rows (the weights, 0.5 GB, come from DRAM in a step).
constexpr int64_t kXBytes = 4 << 20;

#include "panel_packing.h"  // pack_panels

enum class Start { kZero, kLoad };  // sums start from 0 (the first k slice) or from out (the later ones)

// The register block: out[r, 16p : 16p + 16] for r < R (<= kRows), p < NP (<= kPanels) = (start) + sum over
// k < kc of x[r, k] * panel_p[k, 0:16], k in order, panel p at panel + p * panel_stride: the same
// instructions for a sum whatever R and NP, one fused multiply-add per k, so the AVX-512 and AVX2 blocks
// give the same bits.
#if defined(__AVX512F__)
// Each row's 16 sums of a panel and each panel's 16 values of a k in a zmm. The loops over r and p are
// unrolled, so the sums stay in registers. (GCC reloads each panel value as a memory operand of each row's
// fused multiply-add; holding them in registers, with an empty asm, measured 0.92-1.05x: not kept.)
template <int R, int NP, Start kStart>
inline void block(const float* x, int64_t ldx, const float* panel, int64_t panel_stride, int64_t kc, float* out,
                  int64_t ldo) {
  __m512 s[R][NP];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
      s[r][p] = kStart == Start::kLoad ? _mm512_loadu_ps(out + r * ldo + p * kCols) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m512 w[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
#if defined(PAGEDSERVE_PREFETCH_TO_L2)  // Zen 4: 1.03-1.10x at 1 row (scripts/panel_gemm_ab.py)
      prefetch_ahead_to_l2(panel + p * panel_stride + k * kCols);
#endif
      w[p] = _mm512_loadu_ps(panel + p * panel_stride + k * kCols);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) s[r][p] = _mm512_fmadd_ps(xv, w[p], s[r][p]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + r * ldo + p * kCols, s[r][p]);
}
#else
struct Sums {  // one row's 16 sums
  __m256 lo, hi;
};

inline void load(Sums& s, const float* out) { s.lo = _mm256_loadu_ps(out), s.hi = _mm256_loadu_ps(out + 8); }
inline void store(const Sums& s, float* out) { _mm256_storeu_ps(out, s.lo), _mm256_storeu_ps(out + 8, s.hi); }
inline void add_products(Sums& s, const float* x, __m256 w_lo, __m256 w_hi) {
  const __m256 xv = _mm256_broadcast_ss(x);
  s.lo = _mm256_fmadd_ps(xv, w_lo, s.lo), s.hi = _mm256_fmadd_ps(xv, w_hi, s.hi);
}

// One panel (NP = 1). The sums are six named variables, never address-taken: GCC kept an array of them in
// memory, a store per fused multiply-add (2.5x slower); with a table of their addresses for the loads and
// stores it kept some of them there in the blocks it did not inline (the AVX2 build here was 1.10-1.13x
// faster from 16 rows up without it, scripts/panel_gemm_ab.py --tree-isa avx2).
template <int R, int NP, Start kStart>
inline void block(const float* x, int64_t ldx, const float* panel, int64_t /*panel_stride*/, int64_t kc,
                  float* out, int64_t ldo) {
  static_assert(NP == 1, "an AVX2 block is one panel");
  Sums s0{}, s1{}, s2{}, s3{}, s4{}, s5{};
  if constexpr (kStart == Start::kLoad) {
    if constexpr (R > 0) load(s0, out);
    if constexpr (R > 1) load(s1, out + ldo);
    if constexpr (R > 2) load(s2, out + 2 * ldo);
    if constexpr (R > 3) load(s3, out + 3 * ldo);
    if constexpr (R > 4) load(s4, out + 4 * ldo);
    if constexpr (R > 5) load(s5, out + 5 * ldo);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w_lo = _mm256_loadu_ps(panel + k * kCols), w_hi = _mm256_loadu_ps(panel + k * kCols + 8);
    if constexpr (R > 0) add_products(s0, x + k, w_lo, w_hi);
    if constexpr (R > 1) add_products(s1, x + ldx + k, w_lo, w_hi);
    if constexpr (R > 2) add_products(s2, x + 2 * ldx + k, w_lo, w_hi);
    if constexpr (R > 3) add_products(s3, x + 3 * ldx + k, w_lo, w_hi);
    if constexpr (R > 4) add_products(s4, x + 4 * ldx + k, w_lo, w_hi);
    if constexpr (R > 5) add_products(s5, x + 5 * ldx + k, w_lo, w_hi);
  }
  if constexpr (R > 0) store(s0, out);
  if constexpr (R > 1) store(s1, out + ldo);
  if constexpr (R > 2) store(s2, out + 2 * ldo);
  if constexpr (R > 3) store(s3, out + 3 * ldo);
  if constexpr (R > 4) store(s4, out + 4 * ldo);
  if constexpr (R > 5) store(s5, out + 5 * ldo);
}
#endif

// block<rows, NP>: the instantiation with that many sums in registers (1 <= rows <= kRows).
template <int NP, Start kStart>
inline void rows_block(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t panel_stride,
                       int64_t kc, float* out, int64_t ldo) {
  static_assert(kRows == 6, "one case per row count below");
  switch (rows) {
    case 1: block<1, NP, kStart>(x, ldx, panel, panel_stride, kc, out, ldo); break;
    case 2: block<2, NP, kStart>(x, ldx, panel, panel_stride, kc, out, ldo); break;
    case 3: block<3, NP, kStart>(x, ldx, panel, panel_stride, kc, out, ldo); break;
    case 4: block<4, NP, kStart>(x, ldx, panel, panel_stride, kc, out, ldo); break;
    case 5: block<5, NP, kStart>(x, ldx, panel, panel_stride, kc, out, ldo); break;
    default: block<6, NP, kStart>(x, ldx, panel, panel_stride, kc, out, ldo); break;
  }
}

// rows_block<panels> (1 <= panels <= kPanels; the cases past kPanels are never taken, their clamped
// instantiations only make the switch compile).
template <Start kStart>
inline void group_block(int64_t panels, int64_t rows, const float* x, int64_t ldx, const float* panel,
                        int64_t panel_stride, int64_t kc, float* out, int64_t ldo) {
  constexpr auto at_most = [](int p) { return static_cast<int>(std::min<int64_t>(p, kPanels)); };
  static_assert(kPanels <= 4, "one case per panel count below");
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(panels >= 1 && panels <= kPanels);
  switch (panels) {
    case 1: rows_block<1, kStart>(rows, x, ldx, panel, panel_stride, kc, out, ldo); break;
    case 2: rows_block<at_most(2), kStart>(rows, x, ldx, panel, panel_stride, kc, out, ldo); break;
    case 3: rows_block<at_most(3), kStart>(rows, x, ldx, panel, panel_stride, kc, out, ldo); break;
    default: rows_block<kPanels, kStart>(rows, x, ldx, panel, panel_stride, kc, out, ldo); break;
  }
}

// Rows m0..m1 of `panels` (<= kPanels) consecutive panels' output columns (out, rows ldo apart): every k
// slice in order over the rows, then the bias (16 values a panel, or none).
void panel_rows(const float* x, int64_t K, const float* panel, int64_t panels, const float* bias, float* out,
                int64_t ldo, int64_t m0, int64_t m1) {
  const int64_t slices = (K + kKc - 1) / kKc, slice = (K + slices - 1) / slices;  // K in equal slices of <= kKc
  const int64_t stride = K * kCols;  // one panel to the next
  for (int64_t k0 = 0; k0 < K; k0 += slice) {
    const int64_t kc = std::min(slice, K - k0);
    for (int64_t m = m0; m < m1; m += kRows) {
      const int64_t rows = std::min(kRows, m1 - m);
      if (k0 == 0)
        group_block<Start::kZero>(panels, rows, x + m * K, K, panel, stride, kc, out + m * ldo, ldo);
      else
        group_block<Start::kLoad>(panels, rows, x + m * K + k0, K, panel + k0 * kCols, stride, kc, out + m * ldo, ldo);
    }
  }
  if (bias == nullptr) return;
  for (int64_t m = m0; m < m1; ++m)  // one add per output (vectorised by the compiler)
    for (int64_t c = 0; c < panels * kCols; ++c) out[m * ldo + c] += bias[c];
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                        int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be contiguous float32 [M, K] on the CPU");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = (N + kCols - 1) / kCols;
  TORCH_CHECK(K > 0 && N > 0, "x [M, K] and out [M, N] need K > 0 and N > 0, got K = ", K, ", N = ", N);
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(0) == P && panels.size(1) == K && panels.size(2) == kCols,
              "panels must be pack_panels of a [", N, ", ", K, "] weight");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be contiguous float32 [", N, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Rows per pass over the panels: as many as fit kXBytes, in passes of equal size (each pass reads every
  // panel again: a last pass of a few rows would stream the weights for little work).
  const int64_t most = std::max(kRows, kXBytes / (K * 4) / kRows * kRows), passes = (M + most - 1) / most;
  const int64_t mc = ((M + passes - 1) / passes + kRows - 1) / kRows * kRows, full = N / kCols, tail = N - full * kCols;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {  // each thread its own panels (output columns)
    std::vector<float> scratch(tail > 0 && p1 > full ? mc * kCols : 0);  // the last, partial panel's rows
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
      const int64_t m1 = std::min(M, m0 + mc);
      for (int64_t p = p0; p < std::min(p1, full); p += kPanels) {  // groups of kPanels full panels
        const int64_t panels = std::min(kPanels, std::min(p1, full) - p);
        panel_rows(xp, K, wp + p * K * kCols, panels, b == nullptr ? nullptr : b + p * kCols, op + p * kCols, N, m0,
                   m1);
      }
      if (p1 <= full) continue;
      float tail_bias[kCols] = {};
      if (b != nullptr) std::copy(b + full * kCols, b + N, tail_bias);
      panel_rows(xp + m0 * K, K, wp + full * K * kCols, 1, b == nullptr ? nullptr : tail_bias, scratch.data(), kCols,
                 0, m1 - m0);
      for (int64_t m = m0; m < m1; ++m)
        std::copy_n(scratch.data() + (m - m0) * kCols, tail, op + m * N + full * kCols);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve_panels, m) {
  m.def("pack_panels(Tensor weight, Tensor(a!) panels) -> ()");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_panels, CPU, m) {
  m.impl("pack_panels", TORCH_FN(pack_panels));
  m.impl("panel_linear", TORCH_FN(panel_linear));
}
