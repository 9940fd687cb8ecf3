// 16-float vector helpers of the CPU paged-attention op (paged_attention_cpu.cpp includes this
// inside its anonymous namespace, after kLanes and kKeyTile, and <immintrin.h> on x86 before it):
// loads that widen to float32, exp, folds, bf16 rounding.
// Part of the op's build: cpu_op.py hashes every header in this folder with the source.
#pragma once

// 16 floats as one value (GCC/Clang vector extensions: zmm on AVX-512, two ymm on AVX2).
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

template <typename scalar_t>
inline vf16 load16(const scalar_t* p) {
  float tmp[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  vf16 v;
  __builtin_memcpy(&v, tmp, sizeof v);
  return v;
}

template <>
inline vf16 load16<float>(const float* p) {
  vf16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 -> float32: a bfloat16 is the high 16 bits of the float (zero-extend, shift; exact).
template <>
inline vf16 load16<c10::BFloat16>(const c10::BFloat16* p) {
  typedef uint16_t vu16x16 __attribute__((vector_size(32)));
  vu16x16 halves;
  __builtin_memcpy(&halves, p, sizeof halves);
  const vi16 bits = __builtin_convertvector(halves, vi16) << 16;
  vf16 v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
}

// 32 bfloat16 -> their even and their odd channels as float32 (exact): in each 32-bit word of the pair
// the even channel is the low half (shifted up) and the odd one the high half (masked).
inline void load_pairs(const c10::BFloat16* p, vf16& even, vf16& odd) {
  vi16 words;
  __builtin_memcpy(&words, p, sizeof words);
  const vi16 e = words << 16, o = words & static_cast<int32_t>(0xFFFF0000u);
  __builtin_memcpy(&even, &e, sizeof even);
  __builtin_memcpy(&odd, &o, sizeof odd);
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
  __builtin_memcpy(&v, f, sizeof v);
#endif
#else
  float tmp[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  __builtin_memcpy(&v, tmp, sizeof v);
#endif
  return v;
}

inline vf16 splat(float x) { return vf16{} + x; }

// e^x lane by lane for x <= 0: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), e^r by its
// degree-6 Taylor polynomial (truncation < 1.3e-7 relative), 2^n from the exponent bits. Lanes
// below -87 (including -inf) give 0.
inline vf16 exp_nonpositive(vf16 x) {
  const vf16 clamped = x < -87.0f ? splat(-87.0f) : x;
  const vf16 n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const vf16 r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
  vf16 p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  return x < -87.0f ? vf16{} : p * reinterpret_cast<const vf16&>(bits);
}

inline vf16 vmax(vf16 a, vf16 b) { return a > b ? a : b; }

// Rounds non-negative finite lanes to bfloat16 (to nearest, ties to even), as float.
inline vf16 round_bf16(vf16 x) {
  vi16 bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & static_cast<int32_t>(0xFFFF0000u);
  __builtin_memcpy(&x, &bits, sizeof x);
  return x;
}

// Horizontal max / sum by halving folds (4 shuffles instead of 15 lane extractions).
inline vf16 fold_max(vf16 v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  return vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
}

inline float reduce_max(vf16 v) { return fold_max(v)[0]; }

inline float reduce_sum(vf16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// Sums each of 16 vectors into one lane: out[j] = sum of p[j]'s lanes. A tree of half-folds that
// interleaves the vectors (45 shuffles and adds instead of 16 horizontal sums).
inline vf16 transpose_sum(vf16 p[kKeyTile]) {
  vf16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
