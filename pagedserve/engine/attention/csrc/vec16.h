// 16-float vector helpers of the CPU paged-attention op (paged_attention_cpu.cpp includes this
// inside its anonymous namespace, after kLanes and kKeyTile, and <immintrin.h> on x86 before it):
// loads that widen to float32, exp, bf16 rounding; the vector type itself, the comparisons, folds and
// the transpose-sum come from wide16.h (64-byte vectors) or halves16.h (AVX2 without AVX-512).
// Part of the op's build: cpu_op.py hashes every header in this folder with the source.
#pragma once

#if defined(__AVX2__) && !defined(__AVX512F__)
#include "halves16.h"
#else
#include "wide16.h"
#endif

template <typename scalar_t>
inline vf16 load16(const scalar_t* p) {
  float tmp[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  return load_floats(tmp);
}

template <>
inline vf16 load16<float>(const float* p) {
  return load_floats(p);
}

// bfloat16 -> float32: a bfloat16 is the high 16 bits of the float (zero-extend, shift; exact).
template <>
inline vf16 load16<c10::BFloat16>(const c10::BFloat16* p) {
  return as_float(widen_u16(p) << 16);
}

// 32 bfloat16 -> their even and their odd channels as float32 (exact): in each 32-bit word of the pair
// the even channel is the low half (shifted up) and the odd one the high half (masked).
inline void load_pairs(const c10::BFloat16* p, vf16& even, vf16& odd) {
  const vi16 words = load_ints(p);
  even = as_float(words << 16);
  odd = as_float(words & static_cast<int32_t>(0xFFFF0000u));
}

// fp8_e5m2 -> float32: an e5m2 byte is the high byte of an IEEE half (same exponent bias, 2 of its 10
// significand bits), so the bytes interleaved with zero low bytes are halves, widened exactly by the
// F16C / AVX-512F half->float conversion (subnormals, inf and NaN included); elsewhere c10's scalar one.
template <>
inline vf16 load16<c10::Float8_e5m2>(const c10::Float8_e5m2* p) {
  vf16 v;
#if defined(__F16C__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_unpacklo_epi8(_mm_setzero_si128(), bytes);  // halves of bytes 0..7
  const __m128i hi = _mm_unpackhi_epi8(_mm_setzero_si128(), bytes);  // halves of bytes 8..15
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_set_m128i(hi, lo));
  __builtin_memcpy(&v, &f, sizeof v);
#else
  const __m256 f[2] = {_mm256_cvtph_ps(lo), _mm256_cvtph_ps(hi)};
  v = load_floats(f);
#endif
#else
  float tmp[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  v = load_floats(tmp);
#endif
  return v;
}

// x in every lane (x - 0 is x for every x, so the compiler drops the subtraction; 0 + x is not, for -0).
inline vf16 splat(float x) { return x - vf16{}; }

// e^x lane by lane for x <= 0: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), e^r by its
// degree-6 Taylor polynomial (truncation < 1.3e-7 relative), 2^n from the exponent bits. Lanes
// below -87 (including -inf) give 0.
inline vf16 exp_nonpositive(vf16 x) {
  const vf16 clamped = where_less(x, splat(-87.0f), splat(-87.0f), x);
  const vf16 n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const vf16 r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
  vf16 p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi16 bits = (to_int(n) + 127) << 23;
  return where_less(x, splat(-87.0f), vf16{}, p * as_float(bits));
}

// Rounds non-negative finite lanes to bfloat16 (to nearest, ties to even), as float.
inline vf16 round_bf16(vf16 x) {
  vi16 bits = as_int(x);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & static_cast<int32_t>(0xFFFF0000u);
  return as_float(bits);
}
