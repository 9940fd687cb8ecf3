// The 16-float vector type of the CPU paged-attention op where the target has 64-byte vectors or no
// AVX2 at all (vec16.h includes this, or halves16.h on AVX2 without AVX-512; both define the same
// names). GCC/Clang vector extensions: one zmm register on AVX-512.
// Part of the op's build: cpu_op.py hashes every header in this folder with the source.
#pragma once

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
constexpr int64_t kRegistersPerVf16 = 1;  // one zmm of 32 on AVX-512 (elsewhere what the compiler makes of it)

// a * b + c rounded once (a fused multiply-add) on AVX-512, whatever the compiler's tuning (halves16.h);
// elsewhere as the compiler contracts it.
inline vf16 mul_add(vf16 a, vf16 b, vf16 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
#else
  return a * b + c;
#endif
}

inline vf16 load_floats(const void* p) {
  vf16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline vi16 load_ints(const void* p) {
  vi16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline vf16 as_float(vi16 bits) { return reinterpret_cast<vf16>(bits); }
inline vi16 as_int(vf16 v) { return reinterpret_cast<vi16>(v); }

inline vi16 lane_index() { return vi16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
inline vf16 to_float(vi16 v) { return __builtin_convertvector(v, vf16); }
inline vi16 to_int(vf16 v) { return __builtin_convertvector(v, vi16); }  // truncates

// 16 uint16 zero-extended to int32.
inline vi16 widen_u16(const void* p) {
  typedef uint16_t vu16x16 __attribute__((vector_size(32)));
  vu16x16 halves;
  __builtin_memcpy(&halves, p, sizeof halves);
  return __builtin_convertvector(halves, vi16);
}

inline vf16 where_less(vf16 a, vf16 b, vf16 if_less, vf16 otherwise) { return a < b ? if_less : otherwise; }

// v's lanes below n, the others `fill`.
inline vf16 first_lanes(vf16 v, int64_t n, float fill) {
  return lane_index() < static_cast<int32_t>(n) ? v : vf16{} + fill;
}

inline vf16 wide_max(vf16 a, vf16 b) { return a > b ? a : b; }

// Horizontal max / sum by halving folds (4 shuffles instead of 15 lane extractions).
inline float reduce_max(vf16 v) {
  v = wide_max(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = wide_max(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = wide_max(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  return wide_max(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14))[0];
}

inline float reduce_sum(vf16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// Sums each of 16 vectors into one lane: out[j] = sum of p[j]'s lanes. A tree of half-folds that
// interleaves the vectors (45 shuffles and adds instead of 16 horizontal sums).
inline vf16 transpose_sum(const vf16 p[kKeyTile]) {
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
