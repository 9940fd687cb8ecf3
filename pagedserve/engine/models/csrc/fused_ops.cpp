// Row-wise ops of a decoder layer fused into one pass each for CPU: RMSNorm, the residual add with
// the RMSNorm after it, the rotary embedding, and SwiGLU's silu(gate) * up. Eager PyTorch runs each as
// 2-8 kernels (pow, sum, div, add, rsqrt, mul, mul; mul x4, sub, add, cat; silu, mul), each a pass over
// the activations and a dispatch.
// Decode steps of the default model, fused against eager in one process (scripts/fused_ops_step_ab.py;
// docs/benchmarks.md, "Fused row-wise ops, and one OpenMP team"): 64 sequences 1.02x float32, 1.08x
// bfloat16; one sequence 1.06x / 1.12x.
//
// Each op rounds where its eager form rounds, so that only the order of the sum of squares differs:
//   rms_norm:  y = float(x) * rsqrt(mean(float(x)^2) + eps) * float(w), rounded once to x's dtype
//              (what torch.nn.functional.rms_norm computes, bfloat16 included; Zhang & Sennrich, 2019);
//   add_rms_norm: residual <- dtype(residual + delta), then rms_norm(residual);
//   rotary (rotate-half pairing, Su et al., 2021): out[:half] = dtype(dtype(x1 * cos) - dtype(x2 * sin)),
//              out[half:] = dtype(dtype(x2 * cos) + dtype(x1 * sin)): bit-identical to the eager form;
//   silu_and_mul: out = dtype(float(dtype(silu(g))) * float(u)), silu(g) = g / (1 + exp(-g)) in float32
//              with torch's own vector exp (SLEEF's expf, 1-ulp, as torch's CPU silu kernel takes it):
//              bit-identical to F.silu(gate).mul_(up) where this build's vector width is torch's.
// Floating-point contraction is off (an FMA would round once where the eager ops round twice).
//
// Layouts (float32 or bfloat16; weight, cos and sin in x's dtype):
//   x, residual, delta  [T, H] (rows may be strided, the last dimension contiguous); weight [H]
//   rotary: x [T, n, D] (last dimension contiguous), cos and sin [T, 1, D/2] -> out [T, n, D] contiguous
//   silu_and_mul: gate_up [T, 2I] (gate columns first; last dimension contiguous) -> out [T, I] contiguous
#pragma GCC optimize("fp-contract=off")
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sleef.h>  // shipped in torch's include folder; libtorch_cpu exports the functions

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // partial sums of squares: one AVX-512 vector of float32
// Elements one thread takes before a second one helps: a pass over 64 K elements takes ~15 us on one
// core, and a parallel region's start and end cost several us (~100 us while two OpenMP teams shared
// the 2-core machine: engine/openmp_threads.py).
constexpr int64_t kGrainElements = 1 << 16;

inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T> inline T from_float(float v) { return static_cast<T>(v); }

template <typename T>
float inverse_rms(const float* row, int64_t width, double eps) {
  float partial[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= width; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) partial[l] += row[j + l] * row[j + l];
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
  for (; j < width; ++j) sum += row[j] * row[j];
  return 1.f / std::sqrt(sum / static_cast<float>(width) + static_cast<float>(eps));
}

// One row: optionally residual += delta (rounded to T), then out = rms_norm(residual).
template <typename T>
void norm_row(T* residual, const T* delta, const T* weight, T* out, int64_t width, double eps, float* scratch) {
  for (int64_t j = 0; j < width; ++j) {
    float v = to_float(residual[j]);
    if (delta != nullptr) {
      const T sum = from_float<T>(v + to_float(delta[j]));
      residual[j] = sum;
      v = to_float(sum);
    }
    scratch[j] = v;
  }
  const float scale = inverse_rms<T>(scratch, width, eps);
  for (int64_t j = 0; j < width; ++j) out[j] = from_float<T>(scratch[j] * scale * to_float(weight[j]));
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name, " must be a CPU [T, H] tensor with a contiguous last dimension");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be a contiguous [H] tensor of ", name, "'s dtype");
}

template <typename T>
void norm_rows(const at::Tensor& residual, const at::Tensor* delta, const at::Tensor& weight, at::Tensor& out, double eps) {
  const int64_t rows = residual.size(0), width = residual.size(1);
  T* r = residual.data_ptr<T>();
  const T* d = delta != nullptr ? delta->data_ptr<T>() : nullptr;
  const int64_t r_stride = residual.stride(0), d_stride = delta != nullptr ? delta->stride(0) : 0;
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(width);
    for (int64_t i = begin; i < end; ++i)
      norm_row<T>(r + i * r_stride, d != nullptr ? d + i * d_stride : nullptr, weight.data_ptr<T>(),
                  out.data_ptr<T>() + i * width, width, eps, scratch.data());
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "x");
  at::Tensor out = at::empty(x.sizes(), x.options());
  // norm_rows writes the residual only when there is a delta: x is read, never written, here.
  if (x.scalar_type() == at::kFloat) norm_rows<float>(x, nullptr, weight, out, eps);
  else norm_rows<c10::BFloat16>(x, nullptr, weight, out, eps);
  return out;
}

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(residual, weight, "residual");
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type() && delta.stride(1) == 1,
              "delta must match residual's [T, H] shape and dtype, with a contiguous last dimension");
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  if (residual.scalar_type() == at::kFloat) norm_rows<float>(residual, &delta, weight, out, eps);
  else norm_rows<c10::BFloat16>(residual, &delta, weight, out, eps);
  return out;
}

template <typename T>
void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  const T* in = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* ct = c + t * half;
      const T* st = s + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x1 = in + t * x.stride(0) + h * x.stride(1);
        const T* x2 = x1 + half;
        T* o1 = o + (t * heads + h) * 2 * half;
        T* o2 = o1 + half;
        for (int64_t j = 0; j < half; ++j) {
          const float a = to_float(x1[j]), b = to_float(x2[j]), cj = to_float(ct[j]), sj = to_float(st[j]);
          o1[j] = from_float<T>(to_float(from_float<T>(a * cj)) - to_float(from_float<T>(b * sj)));
          o2[j] = from_float<T>(to_float(from_float<T>(b * cj)) + to_float(from_float<T>(a * sj)));
        }
      }
    }
  });
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be a CPU [T, n, D] tensor with a contiguous last dimension and D even");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t half = x.size(2) / 2;
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == x.scalar_type() && table->is_contiguous() && table->numel() == x.size(0) * half,
                "cos and sin must be contiguous [T, 1, D/2] tensors of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) rotate_rows<float>(x, cos, sin, out);
  else rotate_rows<c10::BFloat16>(x, cos, sin, out);
  return out;
}

// out[j] = in[j] / (1 + exp(-in[j])) for j < n: the operations of torch's vectorized CPU silu
// (Vectorized<float>: neg as a sign flip, SLEEF's expf, add, divide) at the widest vector this build
// has; the scalar tail as torch's (std::exp).
void silu_floats(const float* in, float* out, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_loadu_ps(in + j);
    _mm512_storeu_ps(out + j, _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_xor_ps(sign, x)))));
  }
#elif defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(in + j);
    _mm256_storeu_ps(out + j, _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(sign, x)))));
  }
#endif
  for (; j < n; ++j) out[j] = in[j] / (1.f + std::exp(-in[j]));
}

template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = out.size(0), width = out.size(1), stride = gate_up.stride(0);
  const T* in = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    std::vector<float> gate(width), silu(width);
    for (int64_t i = begin; i < end; ++i) {
      const T* g = in + i * stride;
      const T* u = g + width;
      for (int64_t j = 0; j < width; ++j) gate[j] = to_float(g[j]);
      silu_floats(gate.data(), silu.data(), width);
      for (int64_t j = 0; j < width; ++j)
        o[i * width + j] = from_float<T>(to_float(from_float<T>(silu[j])) * to_float(u[j]));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be a CPU [T, 2I] tensor with a contiguous last dimension");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
              "gate_up must be float32 or bfloat16");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_mul_rows<float>(gate_up, out);
  else silu_mul_rows<c10::BFloat16>(gate_up, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_fused, CPU, m) {
  m.impl("rms_norm", TORCH_FN(rms_norm));
  m.impl("add_rms_norm", TORCH_FN(add_rms_norm));
  m.impl("rotary", TORCH_FN(rotary));
  m.impl("silu_and_mul", TORCH_FN(silu_and_mul));
}
