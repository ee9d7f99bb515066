// 16-float vectors and a vector exp shared by the CPU kernels (attnres_cpu.cpp, window_cpu.cpp).
// Hot functions are compiled per ISA with DS_CLONES (target_clones); the helpers here are
// DS_INLINE, so each clone inlines its own copy. Include inside an anonymous namespace, after
// <cmath>, <cstdint> and <cstring>.

#pragma once

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define DS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DS_CLONES
#endif
#if defined(__GNUC__)
#define DS_INLINE inline __attribute__((always_inline))
#else
#define DS_INLINE inline
#endif

// ---- 16-float vectors -----------------------------------------------------------------------
//
// Explicit lanes instead of relying on the auto-vectoriser: the order of every sum is fixed by this
// code (one zmm on avx512, two ymm on avx2, four xmm on the baseline, identical results).

constexpr int64_t kLanes = 16;
#if defined(__GNUC__)
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
#else
struct vec {  // portable stand-in with the same lane-wise semantics
  float x[kLanes];
  float& operator[](int64_t j) { return x[j]; }
  float operator[](int64_t j) const { return x[j]; }
};
inline vec operator+(vec a, vec b) { for (int64_t j = 0; j < kLanes; ++j) a[j] += b[j]; return a; }
inline vec operator-(vec a, vec b) { for (int64_t j = 0; j < kLanes; ++j) a[j] -= b[j]; return a; }
inline vec operator*(vec a, vec b) { for (int64_t j = 0; j < kLanes; ++j) a[j] *= b[j]; return a; }
inline vec operator*(float s, vec a) { for (int64_t j = 0; j < kLanes; ++j) a[j] *= s; return a; }
inline vec& operator+=(vec& a, vec b) { return a = a + b; }
#endif

DS_INLINE vec vload(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
DS_INLINE void vstore(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
DS_INLINE vec vzero() {
  vec v;
  std::memset(&v, 0, sizeof v);
  return v;
}
DS_INLINE vec vsplat(float x) {
  vec v;
  for (int64_t j = 0; j < kLanes; ++j) v[j] = x;
  return v;
}
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));
typedef float vec2 __attribute__((vector_size(2 * sizeof(float))));
DS_INLINE float hsum(vec v) {  // fixed tree over the lanes: t[j] += t[j + width], width 8, 4, 2, 1
  const vec8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) +
                  __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  const vec2 h2 = __builtin_shufflevector(h4, h4, 0, 1) + __builtin_shufflevector(h4, h4, 2, 3);
  return h2[0] + h2[1];
}
#else
DS_INLINE float hsum(vec v) {  // the same tree, lane by lane
  float t[kLanes];
  std::memcpy(t, &v, sizeof t);
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t j = 0; j < width; ++j) t[j] += t[j + width];
  }
  return t[0];
}
#endif

// exp for x <= 0 (a logit minus the maximum), 16 lanes: 2^n · e^r with n = round(x / ln 2),
// |r| <= ln(2)/2 (ln 2 split in two for an exact reduction) and e^r by its Taylor polynomial to
// degree 7. Within 1.2 ulp of exp over [−87, 0] (checked exhaustively at a stride), in every
// clone; lanes below −87.3 (and −inf) give 0, NaN stays NaN. One call replaces m libm calls.
#if defined(__GNUC__)
DS_INLINE vec vexp_nonpositive(vec x) {
  typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));
  const vec lowest = vsplat(-87.3f);
  const vec xc = x < lowest ? lowest : x;
  const vec shifter = vsplat(12582912.0f);  // 1.5 · 2^23: adding it rounds to an integer
  const vec fn = (xc * vsplat(1.44269504088896341f) + shifter) - shifter;
  vec r = xc - fn * vsplat(0.693145751953125f);
  r = r - fn * vsplat(1.42860682030941723e-6f);
  vec poly = vsplat(1.0f / 5040.0f);
  poly = poly * r + vsplat(1.0f / 720.0f);
  poly = poly * r + vsplat(1.0f / 120.0f);
  poly = poly * r + vsplat(1.0f / 24.0f);
  poly = poly * r + vsplat(1.0f / 6.0f);
  poly = poly * r + vsplat(0.5f);
  poly = poly * r + vsplat(1.0f);
  poly = poly * r + vsplat(1.0f);
  const ivec bits = (__builtin_convertvector(fn, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const vec e = poly * scale;
  return x < lowest ? vzero() : e;
}
#else
DS_INLINE vec vexp_nonpositive(vec x) {  // the portable stand-in: libm, lane by lane
  for (int64_t j = 0; j < kLanes; ++j) x[j] = std::exp(x[j]);
  return x;
}
#endif
