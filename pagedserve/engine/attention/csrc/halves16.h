// The 16-float vector type of the CPU paged-attention op on AVX2 without AVX-512 (vec16.h includes
// this instead of wide16.h; both define the same names): two 8-lane halves, one ymm register each.
// GCC has no machine mode for a 64-byte vector without AVX-512, so a 64-byte vector-extension value
// is a block of memory there: copied through general registers, compared and shuffled lane by lane.
// The op, written on such values, ran at ~4 GB/s on a 2-core AVX2 EPYC whether its K/V came from DRAM
// or from the cache (docs/benchmarks.md, "The attention op on AVX2"). Every operation here works on the
// halves in the order of operations of wide16.h's, so both give the same bits.
// Part of the op's build: cpu_op.py hashes every header in this folder with the source.
#pragma once

#include <type_traits>

typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

// Lanes 0-7 in h[0], 8-15 in h[1]; the operators of a vector-extension type, half by half.
template <typename H>
struct Halves {
  H h[2];
  auto operator[](int i) const { return h[i >> 3][i & 7]; }
  Halves& operator+=(Halves b) { return *this = *this + b; }
  friend Halves operator+(Halves a, Halves b) { return {{a.h[0] + b.h[0], a.h[1] + b.h[1]}}; }
  friend Halves operator-(Halves a, Halves b) { return {{a.h[0] - b.h[0], a.h[1] - b.h[1]}}; }
  friend Halves operator*(Halves a, Halves b) { return {{a.h[0] * b.h[0], a.h[1] * b.h[1]}}; }
  friend Halves operator&(Halves a, Halves b) { return {{a.h[0] & b.h[0], a.h[1] & b.h[1]}}; }
  template <typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>
  friend Halves operator+(Halves a, S s) { return {{a.h[0] + s, a.h[1] + s}}; }
  template <typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>
  friend Halves operator-(Halves a, S s) { return {{a.h[0] - s, a.h[1] - s}}; }
  template <typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>
  friend Halves operator-(S s, Halves a) { return {{s - a.h[0], s - a.h[1]}}; }
  template <typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>
  friend Halves operator*(Halves a, S s) { return {{a.h[0] * s, a.h[1] * s}}; }
  template <typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>
  friend Halves operator*(S s, Halves a) { return {{s * a.h[0], s * a.h[1]}}; }
  template <typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>
  friend Halves operator&(Halves a, S s) { return {{a.h[0] & s, a.h[1] & s}}; }
  friend Halves operator<<(Halves a, int n) { return {{a.h[0] << n, a.h[1] << n}}; }
  friend Halves operator>>(Halves a, int n) { return {{a.h[0] >> n, a.h[1] >> n}}; }
};
typedef Halves<vf8> vf16;
typedef Halves<vi8> vi16;
constexpr int64_t kRegistersPerVf16 = 2;  // of the 16 ymm registers

// a * b + c rounded once (a fused multiply-add), half by half, on every CPU with FMA whatever the
// compiler's tuning: GCC's tuning for Zen 3 (avoid-fma-max-bits) leaves a loop-carried a * b + c as a
// multiply and an add, so a sum came out in other bits than where the same code is contracted (found
// by an A/B: MHA scores; scripts/attention_op_identity.py).
inline vf8 mul_add(vf8 a, vf8 b, vf8 c) {
#if defined(__FMA__)
  return reinterpret_cast<vf8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}
inline vf16 mul_add(vf16 a, vf16 b, vf16 c) {
  return {{mul_add(a.h[0], b.h[0], c.h[0]), mul_add(a.h[1], b.h[1], c.h[1])}};
}

// Loads and bit casts half by half: a memcpy of all 64 bytes became four 16-byte stores to the stack
// and two 32-byte loads from them, each of which waited for its stores (no store forwarding).
inline vf16 load_floats(const void* p) {
  vf16 v;
  __builtin_memcpy(&v.h[0], p, sizeof v.h[0]);
  __builtin_memcpy(&v.h[1], static_cast<const char*>(p) + sizeof v.h[0], sizeof v.h[1]);
  return v;
}
inline vi16 load_ints(const void* p) {
  vi16 v;
  __builtin_memcpy(&v.h[0], p, sizeof v.h[0]);
  __builtin_memcpy(&v.h[1], static_cast<const char*>(p) + sizeof v.h[0], sizeof v.h[1]);
  return v;
}
inline vf16 as_float(vi16 bits) { return {{reinterpret_cast<vf8>(bits.h[0]), reinterpret_cast<vf8>(bits.h[1])}}; }
inline vi16 as_int(vf16 v) { return {{reinterpret_cast<vi8>(v.h[0]), reinterpret_cast<vi8>(v.h[1])}}; }

inline vi16 lane_index() { return {{vi8{0, 1, 2, 3, 4, 5, 6, 7}, vi8{8, 9, 10, 11, 12, 13, 14, 15}}}; }
inline vf16 to_float(vi16 v) { return {{__builtin_convertvector(v.h[0], vf8), __builtin_convertvector(v.h[1], vf8)}}; }
inline vi16 to_int(vf16 v) { return {{__builtin_convertvector(v.h[0], vi8), __builtin_convertvector(v.h[1], vi8)}}; }

// 16 uint16 zero-extended to int32.
inline vi16 widen_u16(const void* p) {
  typedef uint16_t vu16x8 __attribute__((vector_size(16)));
  vu16x8 lo, hi;
  __builtin_memcpy(&lo, p, sizeof lo);
  __builtin_memcpy(&hi, static_cast<const char*>(p) + sizeof lo, sizeof hi);
  return {{__builtin_convertvector(lo, vi8), __builtin_convertvector(hi, vi8)}};
}

inline vf16 where_less(vf16 a, vf16 b, vf16 if_less, vf16 otherwise) {
  return {{a.h[0] < b.h[0] ? if_less.h[0] : otherwise.h[0], a.h[1] < b.h[1] ? if_less.h[1] : otherwise.h[1]}};
}

// v's lanes below n, the others `fill`.
inline vf16 first_lanes(vf16 v, int64_t n, float fill) {
  const vi16 lane = lane_index();
  const int32_t n32 = static_cast<int32_t>(n);
  return {{lane.h[0] < n32 ? v.h[0] : vf8{} + fill, lane.h[1] < n32 ? v.h[1] : vf8{} + fill}};
}

inline vf8 max8(vf8 a, vf8 b) { return a > b ? a : b; }

// The reductions by halving folds, the first one combining the two halves.
inline float reduce_max(vf16 v) {
  vf8 m = max8(v.h[0], v.h[1]);
  m = max8(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3));
  m = max8(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5));
  return max8(m, __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6))[0];
}

inline float reduce_sum(vf16 v) {
  vf8 s = v.h[0] + v.h[1];
  s += __builtin_shufflevector(s, s, 4, 5, 6, 7, 0, 1, 2, 3);
  s += __builtin_shufflevector(s, s, 2, 3, 0, 1, 6, 7, 4, 5);
  s += __builtin_shufflevector(s, s, 1, 0, 3, 2, 5, 4, 7, 6);
  return s[0];
}

// Sums each of 16 vectors into one lane (out[j] = sum of p[j]'s lanes): s[j] = p[j]'s halves added,
// then folds by 4, 2 and 1 lanes that keep the sums of consecutive vectors side by side (wide16.h's
// tree, half as wide).
inline vf16 transpose_sum(const vf16 p[kKeyTile]) {
  static_assert(kKeyTile == 16 && kLanes == 16, "the tree below sums 16 vectors of 16 lanes");
  vf8 s[16], u[8], w[4];
  for (int j = 0; j < 16; ++j) s[j] = p[j].h[0] + p[j].h[1];
  for (int k = 0; k < 8; ++k)
    u[k] = __builtin_shufflevector(s[2 * k], s[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(s[2 * k], s[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int m = 0; m < 4; ++m)
    w[m] = __builtin_shufflevector(u[2 * m], u[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(u[2 * m], u[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  vf16 out;
  for (int h = 0; h < 2; ++h)
    out.h[h] = __builtin_shufflevector(w[2 * h], w[2 * h + 1], 0, 2, 4, 6, 8, 10, 12, 14) +
               __builtin_shufflevector(w[2 * h], w[2 * h + 1], 1, 3, 5, 7, 9, 11, 13, 15);
  return out;
}
