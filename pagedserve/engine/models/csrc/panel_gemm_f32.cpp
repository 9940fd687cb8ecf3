// y = x @ W^T + bias in float32 on CPUs with AVX2 and FMA, over a weight packed once into panels of
// 16 output columns: a register-blocked GEMM in the manner of BLIS (Van Zee & van de Geijn, "BLIS: A
// Framework for Rapidly Instantiating BLAS Functionality", ACM TOMS 2015; Goto & van de Geijn, "Anatomy
// of High-Performance Matrix Multiplication", ACM TOMS 2008): a 6 x 16 block of sums in 12 vector
// registers, one broadcast of x and two loads of the panel per 12 fused multiply-adds, a panel's
// kKc x 16 slice kept in L1 while x's rows (up to kXBytes of them) pass over it.
//
// Each output element is sum_k x[m, k] * W[n, k] over k = 0, 1, ..., K - 1 in that order (one fused
// multiply-add per k, from 0), then + bias[n]. The order depends on nothing but K: not on how many rows
// the call has, which rows share a block, or how many threads split the columns. So a row's result is
// the same bits alone as in a batch of any size (oneDNN pads one row to two for that; MKL's rows
// change with the batch: scripts/gemm_batch_invariance.py).
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

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kCols = 16;   // output columns of a panel: two 8-float vectors
constexpr int64_t kRows = 6;    // rows of a register block: 6 x 2 sums + 2 panel loads + 1 broadcast = 15 of 16 registers
constexpr int64_t kKc = 256;    // k per pass: a panel's slice is 256 x 16 x 4 B = 16 KiB, half of L1D
// x's rows per pass over the panels: up to 4 MiB of x, one pass for any decode batch of the default model.
// Each pass streams every panel from memory again; with passes of x that fit L2 (256 KiB) the model's
// GEMMs were 1.07x / 1.16x slower at 160 / 256 rows (the weights, 0.5 GB, come from DRAM in a step).
constexpr int64_t kXBytes = 4 << 20;

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

enum class Start { kZero, kLoad };  // sums start from 0 (the first k slice) or from out (the later ones)

struct Sums {  // one row's 16 sums
  __m256 lo, hi;
};

inline void load(Sums& s, const float* out) { s.lo = _mm256_loadu_ps(out), s.hi = _mm256_loadu_ps(out + 8); }
inline void store(const Sums& s, float* out) { _mm256_storeu_ps(out, s.lo), _mm256_storeu_ps(out + 8, s.hi); }
inline void add_products(Sums& s, const float* x, __m256 w_lo, __m256 w_hi) {
  const __m256 xv = _mm256_broadcast_ss(x);
  s.lo = _mm256_fmadd_ps(xv, w_lo, s.lo), s.hi = _mm256_fmadd_ps(xv, w_hi, s.hi);
}

// out[r, 0:16] for r < R (<= kRows) = (start) + sum over k < kc of x[r, k] * panel[k, 0:16], k in order:
// the same instructions for a row whatever R. The sums are six named variables, not an array: GCC kept
// an array of them in memory, a store per fused multiply-add (2.5x slower).
template <int R, Start kStart>
inline void block(const float* x, int64_t ldx, const float* panel, int64_t kc, float* out, int64_t ldo) {
  Sums s0{}, s1{}, s2{}, s3{}, s4{}, s5{};
  Sums* const rows[kRows] = {&s0, &s1, &s2, &s3, &s4, &s5};
  if constexpr (kStart == Start::kLoad)
    for (int r = 0; r < R; ++r) load(*rows[r], out + r * ldo);
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w_lo = _mm256_loadu_ps(panel + k * kCols), w_hi = _mm256_loadu_ps(panel + k * kCols + 8);
    if constexpr (R > 0) add_products(s0, x + k, w_lo, w_hi);
    if constexpr (R > 1) add_products(s1, x + ldx + k, w_lo, w_hi);
    if constexpr (R > 2) add_products(s2, x + 2 * ldx + k, w_lo, w_hi);
    if constexpr (R > 3) add_products(s3, x + 3 * ldx + k, w_lo, w_hi);
    if constexpr (R > 4) add_products(s4, x + 4 * ldx + k, w_lo, w_hi);
    if constexpr (R > 5) add_products(s5, x + 5 * ldx + k, w_lo, w_hi);
  }
  for (int r = 0; r < R; ++r) store(*rows[r], out + r * ldo);
}

template <Start kStart>
inline void rows_block(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t kc, float* out,
                       int64_t ldo) {
  switch (rows) {
    case 1: block<1, kStart>(x, ldx, panel, kc, out, ldo); break;
    case 2: block<2, kStart>(x, ldx, panel, kc, out, ldo); break;
    case 3: block<3, kStart>(x, ldx, panel, kc, out, ldo); break;
    case 4: block<4, kStart>(x, ldx, panel, kc, out, ldo); break;
    case 5: block<5, kStart>(x, ldx, panel, kc, out, ldo); break;
    default: block<6, kStart>(x, ldx, panel, kc, out, ldo); break;
  }
}

// Rows m0..m1 of one panel's 16 output columns (out, rows ldo apart): every k slice in order over the
// rows, then the bias (16 values, or none).
void panel_rows(const float* x, int64_t K, const float* panel, const float* bias, float* out, int64_t ldo,
                int64_t m0, int64_t m1) {
  const int64_t slices = (K + kKc - 1) / kKc, slice = (K + slices - 1) / slices;  // K in equal slices of <= kKc
  for (int64_t k0 = 0; k0 < K; k0 += slice) {
    const int64_t kc = std::min(slice, K - k0);
    for (int64_t m = m0; m < m1; m += kRows) {
      const int64_t rows = std::min(kRows, m1 - m);
      if (k0 == 0)
        rows_block<Start::kZero>(rows, x + m * K, K, panel, kc, out + m * ldo, ldo);
      else
        rows_block<Start::kLoad>(rows, x + m * K + k0, K, panel + k0 * kCols, kc, out + m * ldo, ldo);
    }
  }
  if (bias == nullptr) return;
  const Sums b{_mm256_loadu_ps(bias), _mm256_loadu_ps(bias + 8)};
  for (int64_t m = m0; m < m1; ++m) {
    Sums s;
    load(s, out + m * ldo);
    store({_mm256_add_ps(s.lo, b.lo), _mm256_add_ps(s.hi, b.hi)}, out + m * ldo);
  }
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
      for (int64_t p = p0; p < std::min(p1, full); ++p)
        panel_rows(xp, K, wp + p * K * kCols, b == nullptr ? nullptr : b + p * kCols, op + p * kCols, N, m0, m1);
      if (p1 <= full) continue;
      float tail_bias[kCols] = {};
      if (b != nullptr) std::copy(b + full * kCols, b + N, tail_bias);
      panel_rows(xp + m0 * K, K, wp + full * K * kCols, b == nullptr ? nullptr : tail_bias, scratch.data(), kCols, 0,
                 m1 - m0);
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
