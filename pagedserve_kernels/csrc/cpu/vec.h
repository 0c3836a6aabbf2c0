// Explicit SIMD for the CPU kernels, in GCC/Clang vector extensions rather than intrinsics.
//
// A vfloat is 8 floats: one AVX register on the x86-64-v3/v4 clones, two SSE registers on the
// baseline clone, NEON pairs on Arm, all from the same source. The hot functions of each kernel
// are cloned per instruction set (PAGEDSERVE_CPU_CLONES) and the dynamic loader picks the best
// clone for the machine, so one build, made without -march=native, runs on any x86-64 and uses
// AVX2 + FMA where it can. Kernels that gain from AVX-512's width also build a 16-float variant
// for x86-64-v4 (vfloat16) and pick it at run time. Everything here is inlined into them.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"  // vfloat by value: only across inlined calls
#endif

// GCC 11 names the x86-64 levels; older compilers and other targets build the baseline only.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && \
    defined(__linux__)
#define PAGEDSERVE_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define PAGEDSERVE_CPU_CLONES_X86  // x86-64-v4 code can be built and picked at run time
#else
#define PAGEDSERVE_CPU_CLONES
#endif

// Lanes of a and b (indices 0-15 across both) picked into a new vector; GCC before 12 spells it
// __builtin_shuffle with an index vector.
#if defined(__clang__) || __GNUC__ >= 12
#define PAGEDSERVE_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PAGEDSERVE_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vint{__VA_ARGS__})
#endif
#define PAGEDSERVE_INLINE inline __attribute__((always_inline))

namespace pagedserve::cpu {

using vfloat = float __attribute__((vector_size(32)));
using vint = int32_t __attribute__((vector_size(32)));
constexpr int64_t kWidth = 8;  // floats per vfloat

// 16 floats: one AVX-512 register, for code built for x86-64-v4 (PAGEDSERVE_X86_64_V4) and
// picked at run time where cpu_has_avx512().
using vfloat16 = float __attribute__((vector_size(64)));
using vint16 = int32_t __attribute__((vector_size(64)));

// int32 lanes as many as V's float lanes (a vector_size may not depend on a template parameter).
template <typename V>
struct IntLanes;
template <>
struct IntLanes<vfloat> {
  using type = vint;
};
template <>
struct IntLanes<vfloat16> {
  using type = vint16;
};

template <typename V>
constexpr int64_t kLanes = sizeof(V) / sizeof(float);

#ifdef PAGEDSERVE_CPU_CLONES_X86
#define PAGEDSERVE_X86_64_V4 __attribute__((target("arch=x86-64-v4")))
#endif

// Whether this CPU runs x86-64-v4 code. Its features one by one: not every GCC takes the level's
// name here.
inline bool cpu_has_avx512() {
#ifdef PAGEDSERVE_CPU_CLONES_X86
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512cd") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

template <typename V>
PAGEDSERVE_INLINE V load_as(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

template <typename V>
PAGEDSERVE_INLINE void store_as(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

PAGEDSERVE_INLINE vfloat load(const float* p) { return load_as<vfloat>(p); }

PAGEDSERVE_INLINE void store(float* p, vfloat v) { store_as(p, v); }

// Every lane x (`vfloat{} + x` would also add 0.0, which the compiler must keep for the sign
// of -0.0). GCC 12 lowers this helper for the baseline target before it is inlined into a
// clone, so it builds the vector lane by lane (six shuffles): hot loops multiply a vector by
// the scalar instead, which is one broadcast.
PAGEDSERVE_INLINE vfloat splat(float x) { return vfloat{x, x, x, x, x, x, x, x}; }

template <typename V>
PAGEDSERVE_INLINE V vmax(V a, V b) {
  return a > b ? a : b;
}

PAGEDSERVE_INLINE float hsum(vfloat v) {
  float s = 0.0f;
  for (int l = 0; l < kWidth; ++l) s += v[l];
  return s;
}

PAGEDSERVE_INLINE float hmax(vfloat v) {
  float m = v[0];
  for (int l = 1; l < kWidth; ++l) m = m > v[l] ? m : v[l];
  return m;
}

// [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
PAGEDSERVE_INLINE vfloat pair_sums(vfloat a, vfloat b) {
  return PAGEDSERVE_SHUFFLE(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         PAGEDSERVE_SHUFFLE(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// Lane t holds the sum of x[t]'s lanes: eight horizontal sums for the price of about two.
PAGEDSERVE_INLINE vfloat transpose_sums(const vfloat* x) {
  const vfloat lo = pair_sums(pair_sums(x[0], x[1]), pair_sums(x[2], x[3]));
  const vfloat hi = pair_sums(pair_sums(x[4], x[5]), pair_sums(x[6], x[7]));
  return PAGEDSERVE_SHUFFLE(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
         PAGEDSERVE_SHUFFLE(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

// e^x for x <= 0, within about 2 ulp; inputs below -87 give e^-87 (~1.6e-38), not 0.
// x = k ln2 + r with |r| <= ln2 / 2, e^x = 2^k e^r, e^r from its Taylor series to r^7
// (truncation error below 6e-9 relative), 2^k built in the exponent bits.
template <typename V>
PAGEDSERVE_INLINE V exp_nonpositive(V x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // ln 2 split so that k * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  x = vmax(x, V{} - 87.0f);
  const V k = (x * kLog2e + kRound) - kRound;
  const V r = (x - k * kLn2Hi) - k * kLn2Lo;
  V p = V{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  using VI = typename IntLanes<V>::type;
  const VI bits = (__builtin_convertvector(k, VI) + 127) << 23;
  V two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  return p * two_k;
}

// dst[i] = float(src[i]) * a
template <typename T>
PAGEDSERVE_INLINE void load_scaled(const T* src, float a, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * a;
}

template <typename T>
PAGEDSERVE_INLINE void store_scaled(const float* src, float a, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * a);
}

// n rows of a strided tensor, seen as fp32: a float tensor is read in place, any other dtype is
// converted once into `buffer` (rows of `width` floats).
struct Rows {
  const float* data;
  int64_t stride;
  PAGEDSERVE_INLINE const float* operator[](int64_t i) const { return data + i * stride; }
  PAGEDSERVE_INLINE Rows from(int64_t i) const { return {data + i * stride, stride}; }
};

template <typename T>
PAGEDSERVE_INLINE Rows as_float_rows(const T* src, int64_t stride, int64_t n, int64_t width,
                                     float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return {src, stride};
  } else {
    for (int64_t i = 0; i < n; ++i) load_scaled(src + i * stride, 1.0f, buffer + i * width, width);
    return {buffer, width};
  }
}

}  // namespace pagedserve::cpu
