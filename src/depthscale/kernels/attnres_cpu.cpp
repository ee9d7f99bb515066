// Fused CPU kernels for the Attention-Residual depth reads, forward and backward.
//
// Built on first use by depthscale/kernels/attnres_cpu.py (torch.utils.cpp_extension.load) and
// registered as torch ops `depthscale_attnres::*`; model/attnres_ops.py dispatches to them for CPU
// inputs. The math is the one documented in model/attnres_ops.py and kernels/attnres_triton.py.
//
// Layout of the work: one token at a time (threads over tokens, at::parallel_for), all sources of
// that token in one sweep. Per token, the first pass over the m source rows gives every inverse RMS
// and logit (one sweep per row for v·v and all query dots), the softmax runs on 16 lanes (exact max,
// a vector exp, a fixed-tree sum), and the second pass accumulates the outputs; the rows it rereads
// are this token's m·d values, still in L1. Backward likewise: dots, per-token scalars, then one
// sweep that writes each source's gradient once with the query gradients held in registers. Nothing
// is stacked and no [m, N, d] temporary exists. The reads are memory-bound: each pass over a source
// row is what costs, so forward reads every source row once and backward once (plus the chained
// gradient); the arithmetic is kept short enough to hide under the loads.
//
// Determinism and exactness:
// - Reductions over d use explicit 16-float lanes, two accumulators and a fixed tree, never the
//   compiler's reassociation: a token's result does not depend on the pointer's alignment, on N,
//   on the token's position, on the other queries of the batch, or on the thread count.
// - Query gradients are summed per fixed chunk of tokens (the chunk size depends only on N), then
//   the chunk partials are added in order: no atomics, independent of the thread count.
// - The hot functions are compiled for x86-64-v4 (avx512), x86-64-v3 (avx2 + fma) and the baseline
//   (target_clones; the loader picks one per machine, so the cached binary is portable). FMA
//   contraction is on (-ffp-contract=fast): results are bitwise reproducible on a machine; two
//   machines that pick different clones may differ by rounding.
// - Arithmetic is fp32 for fp32/bf16/fp16 sources; stores round to the output's dtype. Phase-1
//   outputs (and their gradients) are in the sources' dtype: fp32 is the accumulator, not storage.
//   The merge takes a phase-1 output in the partial sum's dtype or in fp32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

#include "vec16.h"

// ---- scalar conversions (inlined into every clone) ---------------------------------------------

DS_INLINE float to_float(float x) { return x; }
DS_INLINE float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
DS_INLINE float to_float(c10::Half x) { return static_cast<float>(x); }

// A row of d values as fp32: the row itself for fp32, else converted into buf.
template <typename T>
DS_INLINE const float* as_float(const T* row, float* buf, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t k = 0; k < d; ++k) buf[k] = to_float(row[k]);
    return buf;
  }
}

// Where a row of fp32 results goes: straight into an fp32 output, else into buf (then store_row).
template <typename T>
DS_INLINE float* out_row(T* dst, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    return buf;
  }
}

template <typename T>
DS_INLINE void store_row(T* dst, const float* src, int64_t d) {
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t k = 0; k < d; ++k) dst[k] = static_cast<T>(src[k]);  // round to nearest even
  }
}

// A chained gradient: dst = up + T(t), rounded the way autograd rounds when it adds a separately
// returned gradient T(t) to the accumulated one (computed in fp32, stored in T). For fp32, t is dst.
template <typename T>
DS_INLINE void store_row_plus(T* dst, const float* t, const T* up, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t k = 0; k < d; ++k) dst[k] = up[k] + t[k];
  } else {
    for (int64_t k = 0; k < d; ++k) {
      dst[k] = static_cast<T>(to_float(up[k]) + to_float(static_cast<T>(t[k])));
    }
  }
}

template <typename T>
DS_INLINE void store_grad(T* dst, const float* t, const void* up_base, int64_t offset, int64_t d) {
  if (up_base == nullptr) {
    store_row(dst, t, d);
  } else {
    store_row_plus(dst, t, static_cast<const T*>(up_base) + offset, d);
  }
}

// G dot products v · u_g in one pass over v: per product, two 16-lane accumulators over 32-element
// steps, a zero-padded tail and a fixed tree. Each product's bits do not depend on G.
template <int G>
DS_INLINE void dots(const float* v, const float* const* u, int64_t d, float* out) {
  vec acc0[G], acc1[G];
  for (int g = 0; g < G; ++g) acc0[g] = acc1[g] = vzero();
  int64_t k = 0;
  for (; k + 2 * kLanes <= d; k += 2 * kLanes) {
    const vec v0 = vload(v + k), v1 = vload(v + k + kLanes);
    for (int g = 0; g < G; ++g) {
      acc0[g] += v0 * vload(u[g] + k);
      acc1[g] += v1 * vload(u[g] + k + kLanes);
    }
  }
  if (k + kLanes <= d) {
    const vec v0 = vload(v + k);
    for (int g = 0; g < G; ++g) acc0[g] += v0 * vload(u[g] + k);
    k += kLanes;
  }
  if (k < d) {
    float tv[kLanes] = {}, tu[kLanes] = {};
    std::memcpy(tv, v + k, (d - k) * sizeof(float));
    const vec v1 = vload(tv);
    for (int g = 0; g < G; ++g) {
      std::memcpy(tu, u[g] + k, (d - k) * sizeof(float));
      acc1[g] += v1 * vload(tu);
    }
  }
  for (int g = 0; g < G; ++g) out[g] = hsum(acc0[g] + acc1[g]);
}

DS_INLINE float dot(const float* a, const float* b, int64_t d) {
  float out;
  dots<1>(a, &b, d, &out);
  return out;
}

DS_INLINE float inv_rms_of(float sum_sq, int64_t d, float eps) {  // (mean(v²) + eps)^-½
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(d) + eps);
}

DS_INLINE float inv_rms(const float* v, int64_t d, float eps) {
  return inv_rms_of(dot(v, v, d), d, eps);
}


// Softmax over m logits (exact max, vector exp, a lane-wise then fixed-tree sum): weights into a,
// returns the log-sum-exp. Independent of where the logits sit in memory and of anything else.
DS_INLINE float softmax(const float* z, int64_t m, float* a) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float top = neg_inf;
  for (int64_t i = 0; i < m; ++i) top = std::max(top, z[i]);
  vec sum = vzero();
  for (int64_t i0 = 0; i0 < m; i0 += kLanes) {
    float t[kLanes];
    const int64_t len = std::min(kLanes, m - i0);
    for (int64_t j = 0; j < kLanes; ++j) t[j] = j < len ? z[i0 + j] - top : neg_inf;
    const vec e = vexp_nonpositive(vload(t));
    vstore(t, e);
    std::memcpy(a + i0, t, len * sizeof(float));
    sum += e;
  }
  const float total = hsum(sum);
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < m; ++i) a[i] *= inv;
  return top + std::log(total);
}

// Queries are processed in groups of at most kGroup with the group size a compile-time constant, so
// that per-query scalars and pointers live in registers; the group size never changes a result.
constexpr int kGroup = 4;

// Dispatch over groups: a switch, not a lambda (a lambda that is not inlined would be compiled for
// the baseline ISA, outside the target_clones function).
#define DS_FOR_GROUPS(S, CALL)                                 \
  for (int64_t s0 = 0; s0 < (S); s0 += kGroup) {               \
    switch (std::min<int64_t>(kGroup, (S) - s0)) {             \
      case 1: { constexpr int G = 1; CALL; break; }            \
      case 2: { constexpr int G = 2; CALL; break; }            \
      case 3: { constexpr int G = 3; CALL; break; }            \
      default: { constexpr int G = 4; CALL; break; }           \
    }                                                          \
  }

// ---- phase 1: S queries over m sources ----------------------------------------------------------
//
// Per token n: r_i = (mean(v_i²) + eps)^-½, z_si = r_i (v_i · w_s), a_si = softmax_i z_si,
// out_s = Σ_i a_si v_i (stored in the sources' dtype), lse_s = logsumexp_i z_si (fp32). Saved per
// token (when `save`): r [m], z and a [S, m], token-major so that a token's scalars are contiguous.

struct ReadArgs {
  const void* const* src;  // m source rows' bases, [N, d] each
  int64_t m, S, d;
  const float* w;  // [S, d]
  float eps;
  void* const* out;   // S outputs [N, d], the sources' dtype
  float* const* lse;  // S log-sum-exps [N]
  float* r_save;      // [N, m] or null
  float* z_save;      // [N, S, m] or null
  float* a_save;      // [N, S, m] or null
};

// out_g = Σ_i a[g·m + i] v_i for a group of G queries, sources innermost: one write per element.
template <int G>
DS_INLINE void weighted_sums(const float* const* rows, int64_t m, const float* a, int64_t d,
                             float* const* out) {
  int64_t k = 0;
  for (; k + kLanes <= d; k += kLanes) {
    vec acc[G];
    const vec v0 = vload(rows[0] + k);
    for (int g = 0; g < G; ++g) acc[g] = a[g * m] * v0;
    for (int64_t i = 1; i < m; ++i) {
      const vec vi = vload(rows[i] + k);
      for (int g = 0; g < G; ++g) acc[g] += a[g * m + i] * vi;
    }
    for (int g = 0; g < G; ++g) vstore(out[g] + k, acc[g]);
  }
  for (; k < d; ++k) {
    for (int g = 0; g < G; ++g) {
      float acc = a[g * m] * rows[0][k];
      for (int64_t i = 1; i < m; ++i) acc += a[g * m + i] * rows[i][k];
      out[g][k] = acc;
    }
  }
}

template <typename T>
DS_INLINE void read_forward_body(const ReadArgs& p, int64_t n0, int64_t n1) {
  constexpr bool f32 = std::is_same_v<T, float>;
  const int64_t m = p.m, S = p.S, d = p.d;
  std::vector<float> buf(f32 ? 0 : m * d), obuf(f32 ? 0 : S * d);
  std::vector<const float*> rows(m), w_rows(S);
  std::vector<float*> o_rows(S);
  std::vector<float> r(m), z(S * m), a(S * m), zi(S + 1);
  std::vector<const float*> u(S + 1);
  for (int64_t s = 0; s < S; ++s) w_rows[s] = u[s + 1] = p.w + s * d;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t i = 0; i < m; ++i) {
      const T* row = static_cast<const T*>(p.src[i]) + n * d;
      const float* v = as_float(row, buf.data() + (f32 ? 0 : i * d), d);
      rows[i] = v;
      if (S <= kGroup) {  // v · v among the query dots: one sweep over the row, same bits
        u[0] = v;
        switch (S) {
          case 1: dots<2>(v, u.data(), d, zi.data()); break;
          case 2: dots<3>(v, u.data(), d, zi.data()); break;
          case 3: dots<4>(v, u.data(), d, zi.data()); break;
          default: dots<5>(v, u.data(), d, zi.data()); break;
        }
        r[i] = inv_rms_of(zi[0], d, p.eps);
        for (int64_t s = 0; s < S; ++s) z[s * m + i] = r[i] * zi[s + 1];
      } else {
        r[i] = inv_rms(v, d, p.eps);
        DS_FOR_GROUPS(S, dots<G>(v, w_rows.data() + s0, d, zi.data() + s0))
        for (int64_t s = 0; s < S; ++s) z[s * m + i] = r[i] * zi[s];
      }
    }
    for (int64_t s = 0; s < S; ++s) {
      p.lse[s][n] = softmax(z.data() + s * m, m, a.data() + s * m);
      o_rows[s] = out_row(static_cast<T*>(p.out[s]) + n * d, obuf.data() + (f32 ? 0 : s * d));
    }
    DS_FOR_GROUPS(S, weighted_sums<G>(rows.data(), m, a.data() + s0 * m, d, o_rows.data() + s0))
    for (int64_t s = 0; s < S; ++s) store_row(static_cast<T*>(p.out[s]) + n * d, o_rows[s], d);
    if (p.r_save != nullptr) {
      std::copy(r.begin(), r.end(), p.r_save + n * m);
      std::copy(z.begin(), z.end(), p.z_save + n * S * m);
      std::copy(a.begin(), a.end(), p.a_save + n * S * m);
    }
  }
}

DS_CLONES void read_forward_f32(const ReadArgs& p, int64_t n0, int64_t n1) {
  read_forward_body<float>(p, n0, n1);
}
DS_CLONES void read_forward_bf16(const ReadArgs& p, int64_t n0, int64_t n1) {
  read_forward_body<c10::BFloat16>(p, n0, n1);
}
DS_CLONES void read_forward_f16(const ReadArgs& p, int64_t n0, int64_t n1) {
  read_forward_body<c10::Half>(p, n0, n1);
}

// Backward from do_s (null: zero) and dlse_s (null: zero), with P_si = do_s · v_i and
// D_s = do_s · o_s = Σ_i a_si P_si:
//   g_si = a_si (P_si − D_s + dlse_s) r_i,   c_i = r_i / d · Σ_s g_si z_si
//   dv_i = −c_i v_i + Σ_s (a_si do_s + g_si w_s),   dw_s = Σ_tokens Σ_i g_si v_i

struct ReadGradArgs {
  const void* const* src;
  int64_t m, S, d;
  const float* w;
  const float* r;  // [N, m]
  const float* z;  // [N, S, m]
  const float* a;  // [N, S, m]
  const void* const* d_out;   // S entries [N, d] (sources' dtype), null = zero
  const float* const* d_lse;  // S entries [N], null = zero
  const void* const* d_up;    // m chained gradients [N, d] (sources' dtype) to add, null = none
  void* const* d_src;         // m gradients [N, d], the sources' dtype
};

// For one source row v and a group of G queries: t (= −c v when first, else t) += Σ_g (a_g do_g +
// g_g w_g), element by element in query order; dw_g += g_g v.
template <int G>
DS_INLINE void source_grad(float* t, const float* v, bool first, float neg_c,
                           const float* const* dos, const float* const* ws, float* const* dws,
                           const float* a, const float* g, int64_t m, int64_t d) {
  vec av[G], gv[G];
  for (int j = 0; j < G; ++j) {
    av[j] = vsplat(a[j * m]);
    gv[j] = vsplat(g[j * m]);
  }
  int64_t k = 0;
  for (; k + kLanes <= d; k += kLanes) {
    const vec vv = vload(v + k);
    vec acc = first ? neg_c * vv : vload(t + k);
    for (int j = 0; j < G; ++j) {
      acc += av[j] * vload(dos[j] + k);
      acc += gv[j] * vload(ws[j] + k);
      vstore(dws[j] + k, vload(dws[j] + k) + gv[j] * vv);
    }
    vstore(t + k, acc);
  }
  for (; k < d; ++k) {
    float acc = first ? neg_c * v[k] : t[k];
    for (int j = 0; j < G; ++j) {
      acc += a[j * m] * dos[j][k];
      acc += g[j * m] * ws[j][k];
      dws[j][k] += g[j * m] * v[k];
    }
    t[k] = acc;
  }
}

// Pass 2 of the backward for one token when all S = G queries form one group: per 16-lane chunk,
// sources innermost, the query gradients dw_g stay in registers across the m sources and each
// source's gradient row is written once (t, or up + t for a chained gradient). The arithmetic per
// element is source_grad's followed by store_grad's, in the same order.
template <int G, typename T>
DS_INLINE void source_grads_one_group(const float* const* rows, int64_t m, const float* c,
                                      const float* const* dos, const float* const* ws,
                                      float* const* dws, const float* a, const float* g,
                                      void* const* d_src, const void* const* d_up, int64_t n,
                                      int64_t d) {
  constexpr bool f32 = std::is_same_v<T, float>;
  int64_t k = 0;
  for (; k + kLanes <= d; k += kLanes) {
    vec dov[G], wv[G], dwv[G];
    for (int j = 0; j < G; ++j) {
      dov[j] = vload(dos[j] + k);
      wv[j] = vload(ws[j] + k);
      dwv[j] = vload(dws[j] + k);
    }
    for (int64_t i = 0; i < m; ++i) {
      const vec vv = vload(rows[i] + k);
      vec acc = -c[i] * vv;
      for (int j = 0; j < G; ++j) {
        const float aj = a[j * m + i], gj = g[j * m + i];
        acc += aj * dov[j];
        acc += gj * wv[j];
        dwv[j] += gj * vv;
      }
      T* dst = static_cast<T*>(d_src[i]) + n * d + k;
      const T* up = d_up[i] == nullptr ? nullptr : static_cast<const T*>(d_up[i]) + n * d + k;
      if constexpr (f32) {
        vstore(dst, up == nullptr ? acc : vload(up) + acc);
      } else {
        float t[kLanes];
        vstore(t, acc);
        if (up == nullptr) {
          store_row(dst, t, kLanes);
        } else {
          store_row_plus(dst, t, up, kLanes);
        }
      }
    }
    for (int j = 0; j < G; ++j) vstore(dws[j] + k, dwv[j]);
  }
  for (; k < d; ++k) {
    for (int64_t i = 0; i < m; ++i) {
      float acc = -c[i] * rows[i][k];
      for (int j = 0; j < G; ++j) {
        acc += a[j * m + i] * dos[j][k];
        acc += g[j * m + i] * ws[j][k];
        dws[j][k] += g[j * m + i] * rows[i][k];
      }
      T* dst = static_cast<T*>(d_src[i]) + n * d + k;
      if (d_up[i] == nullptr) {
        if constexpr (f32) {
          *dst = acc;
        } else {
          store_row(dst, &acc, 1);
        }
      } else {
        store_row_plus(dst, &acc, static_cast<const T*>(d_up[i]) + n * d + k, 1);
      }
    }
  }
}

template <typename T>
DS_INLINE void read_backward_body(const ReadGradArgs& p, int64_t n0, int64_t n1, float* dw) {
  constexpr bool f32 = std::is_same_v<T, float>;
  const int64_t m = p.m, S = p.S, d = p.d;
  std::vector<float> buf(f32 ? 0 : m * d), dobuf(f32 ? 0 : S * d), tmp(d), zeros(d, 0.0f);
  std::vector<const float*> rows(m), dos(S), ws(S);
  std::vector<float*> dws(S);
  std::vector<float> P(S * m), g(S * m), c(m), Pi(S);
  for (int64_t s = 0; s < S; ++s) {
    ws[s] = p.w + s * d;
    dws[s] = dw + s * d;
  }
  for (int64_t n = n0; n < n1; ++n) {
    const float* r = p.r + n * m;
    const float* z = p.z + n * S * m;
    const float* a = p.a + n * S * m;
    for (int64_t s = 0; s < S; ++s) {
      dos[s] = p.d_out[s] == nullptr
                   ? zeros.data()
                   : as_float(static_cast<const T*>(p.d_out[s]) + n * d,
                              dobuf.data() + (f32 ? 0 : s * d), d);
    }
    for (int64_t i = 0; i < m; ++i) {
      const T* row = static_cast<const T*>(p.src[i]) + n * d;
      rows[i] = as_float(row, buf.data() + (f32 ? 0 : i * d), d);
      DS_FOR_GROUPS(S, dots<G>(rows[i], dos.data() + s0, d, Pi.data() + s0))
      for (int64_t s = 0; s < S; ++s) P[s * m + i] = Pi[s];
    }
    for (int64_t s = 0; s < S; ++s) {
      float D = 0.0f;
      for (int64_t i = 0; i < m; ++i) D += a[s * m + i] * P[s * m + i];
      const float dl = p.d_lse[s] == nullptr ? 0.0f : p.d_lse[s][n];
      for (int64_t i = 0; i < m; ++i) g[s * m + i] = a[s * m + i] * (P[s * m + i] - D + dl) * r[i];
    }
    for (int64_t i = 0; i < m; ++i) {
      float gz = 0.0f;
      for (int64_t s = 0; s < S; ++s) gz += g[s * m + i] * z[s * m + i];
      c[i] = gz * r[i] / static_cast<float>(d);
    }
    if (S <= kGroup) {  // the usual case (S = sublayers per block): one sweep
#define DS_ONE_GROUP(G)                                                                         \
  source_grads_one_group<G, T>(rows.data(), m, c.data(), dos.data(), ws.data(), dws.data(), a, \
                               g.data(), p.d_src, p.d_up, n, d)
      switch (S) {
        case 1: DS_ONE_GROUP(1); break;
        case 2: DS_ONE_GROUP(2); break;
        case 3: DS_ONE_GROUP(3); break;
        default: DS_ONE_GROUP(4); break;
      }
#undef DS_ONE_GROUP
      continue;
    }
    for (int64_t i = 0; i < m; ++i) {
      T* dst = static_cast<T*>(p.d_src[i]) + n * d;
      float* t = out_row(dst, tmp.data());
      DS_FOR_GROUPS(S, source_grad<G>(t, rows[i], s0 == 0, -c[i], dos.data() + s0, ws.data() + s0,
                                       dws.data() + s0, a + s0 * m + i, g.data() + s0 * m + i, m, d))
      store_grad(dst, t, p.d_up[i], n * d, d);
    }
  }
}

DS_CLONES void read_backward_f32(const ReadGradArgs& p, int64_t n0, int64_t n1, float* dw) {
  read_backward_body<float>(p, n0, n1, dw);
}
DS_CLONES void read_backward_bf16(const ReadGradArgs& p, int64_t n0, int64_t n1, float* dw) {
  read_backward_body<c10::BFloat16>(p, n0, n1, dw);
}
DS_CLONES void read_backward_f16(const ReadGradArgs& p, int64_t n0, int64_t n1, float* dw) {
  read_backward_body<c10::Half>(p, n0, n1, dw);
}

// ---- phase 2: merge a phase-1 result with the partial sum ---------------------------------------
//
// Per token: r = (mean(p²) + eps)^-½, z = r (p · w), α = sigmoid(lse − z), h = lerp(p, o, α).
// Backward from dh: dα = α(1−α) dh · (o − p) = d_lse, dz = −dα,
//   d_o = α dh,  d_p = (1−α) dh + dz r w − dz z r² / d · p,  dw = Σ_tokens dz r p.
// T: the partial sum's dtype; O: the phase-1 output's (and d_o's), T or fp32.

struct MergeArgs {
  const void* o;     // [N, d], O
  const float* lse;  // [N]
  const void* p;     // [N, d], partial's dtype
  const float* w;    // [d]
  int64_t d;
  float eps;
  void* h;  // [N, d], partial's dtype
  float* alpha_save;
  float* z_save;
  float* r_save;  // [N] each, or null
};

template <typename T, typename O>
DS_INLINE void merge_forward_body(const MergeArgs& q, int64_t n0, int64_t n1) {
  const int64_t d = q.d;
  std::vector<float> buf(std::is_same_v<T, float> ? 0 : d), tmp(d);
  std::vector<float> obuf(std::is_same_v<O, float> ? 0 : d);
  for (int64_t n = n0; n < n1; ++n) {
    const float* pr = as_float(static_cast<const T*>(q.p) + n * d, buf.data(), d);
    const float* o = as_float(static_cast<const O*>(q.o) + n * d, obuf.data(), d);
    const float r = inv_rms(pr, d, q.eps);
    const float z = r * dot(pr, q.w, d);
    const float alpha = 1.0f / (1.0f + std::exp(z - q.lse[n]));
    T* h = static_cast<T*>(q.h) + n * d;
    float* t = out_row(h, tmp.data());
    // torch.lerp's two branches: start + α (end − start), or end − (end − start)(1 − α)
    const bool low = alpha < 0.5f;
    const float weight = low ? alpha : 1.0f - alpha;
    const float* base = low ? pr : o;
    const float sign = low ? 1.0f : -1.0f;
    int64_t k = 0;
    for (; k + kLanes <= d; k += kLanes) {
      const vec diff = vload(o + k) - vload(pr + k);
      vstore(t + k, vload(base + k) + (sign * weight) * diff);
    }
    for (; k < d; ++k) t[k] = base[k] + (sign * weight) * (o[k] - pr[k]);
    store_row(h, t, d);
    if (q.alpha_save != nullptr) {
      q.alpha_save[n] = alpha;
      q.z_save[n] = z;
      q.r_save[n] = r;
    }
  }
}

DS_CLONES void merge_forward_f32(const MergeArgs& q, int64_t n0, int64_t n1) {
  merge_forward_body<float, float>(q, n0, n1);
}
DS_CLONES void merge_forward_bf16(const MergeArgs& q, int64_t n0, int64_t n1) {
  merge_forward_body<c10::BFloat16, c10::BFloat16>(q, n0, n1);
}
DS_CLONES void merge_forward_bf16_o32(const MergeArgs& q, int64_t n0, int64_t n1) {
  merge_forward_body<c10::BFloat16, float>(q, n0, n1);
}
DS_CLONES void merge_forward_f16(const MergeArgs& q, int64_t n0, int64_t n1) {
  merge_forward_body<c10::Half, c10::Half>(q, n0, n1);
}
DS_CLONES void merge_forward_f16_o32(const MergeArgs& q, int64_t n0, int64_t n1) {
  merge_forward_body<c10::Half, float>(q, n0, n1);
}

struct MergeGradArgs {
  const void* o;  // O
  const void* p;
  const float* w;
  const float* alpha;
  const float* z;
  const float* r;
  const void* dh;    // partial's dtype
  const void* d_up;  // chained gradient of the partial sum to add (partial's dtype), or null
  int64_t d;
  void* d_o;  // O
  float* d_lse;
  void* d_p;  // partial's dtype
};

template <typename T, typename O>
DS_INLINE void merge_backward_body(const MergeGradArgs& q, int64_t n0, int64_t n1, float* dw) {
  constexpr bool f32 = std::is_same_v<T, float>;
  const int64_t d = q.d;
  std::vector<float> pbuf(f32 ? 0 : d), dhbuf(f32 ? 0 : d), tmp(d);
  std::vector<float> obuf(std::is_same_v<O, float> ? 0 : d), dobuf(obuf.size());
  for (int64_t n = n0; n < n1; ++n) {
    const float* pr = as_float(static_cast<const T*>(q.p) + n * d, pbuf.data(), d);
    const float* dh = as_float(static_cast<const T*>(q.dh) + n * d, dhbuf.data(), d);
    const float* o = as_float(static_cast<const O*>(q.o) + n * d, obuf.data(), d);
    const float alpha = q.alpha[n], z = q.z[n], r = q.r[n];
    const float d_alpha = (dot(dh, o, d) - dot(dh, pr, d)) * alpha * (1.0f - alpha);
    q.d_lse[n] = d_alpha;
    const float coef = -d_alpha * r;
    const float rms = -d_alpha * z * r * r / static_cast<float>(d);
    const float beta = 1.0f - alpha;
    O* d_o_dst = static_cast<O*>(q.d_o) + n * d;
    float* d_o = out_row(d_o_dst, dobuf.data());
    T* dst = static_cast<T*>(q.d_p) + n * d;
    float* t = out_row(dst, tmp.data());
    const float* w = q.w;
    int64_t k = 0;
    for (; k + kLanes <= d; k += kLanes) {
      const vec dhk = vload(dh + k), pk = vload(pr + k);
      vstore(d_o + k, alpha * dhk);
      vstore(t + k, beta * dhk + coef * vload(w + k) - rms * pk);
      vstore(dw + k, vload(dw + k) + coef * pk);
    }
    for (; k < d; ++k) {
      d_o[k] = alpha * dh[k];
      t[k] = beta * dh[k] + coef * w[k] - rms * pr[k];
      dw[k] += coef * pr[k];
    }
    store_row(d_o_dst, d_o, d);
    store_grad(dst, t, q.d_up, n * d, d);
  }
}

DS_CLONES void merge_backward_f32(const MergeGradArgs& q, int64_t n0, int64_t n1, float* dw) {
  merge_backward_body<float, float>(q, n0, n1, dw);
}
DS_CLONES void merge_backward_bf16(const MergeGradArgs& q, int64_t n0, int64_t n1, float* dw) {
  merge_backward_body<c10::BFloat16, c10::BFloat16>(q, n0, n1, dw);
}
DS_CLONES void merge_backward_bf16_o32(const MergeGradArgs& q, int64_t n0, int64_t n1,
                                       float* dw) {
  merge_backward_body<c10::BFloat16, float>(q, n0, n1, dw);
}
DS_CLONES void merge_backward_f16(const MergeGradArgs& q, int64_t n0, int64_t n1, float* dw) {
  merge_backward_body<c10::Half, c10::Half>(q, n0, n1, dw);
}
DS_CLONES void merge_backward_f16_o32(const MergeGradArgs& q, int64_t n0, int64_t n1,
                                      float* dw) {
  merge_backward_body<c10::Half, float>(q, n0, n1, dw);
}

// ---- drivers ----------------------------------------------------------------------------------

constexpr int64_t kGrain = 16;        // tokens per parallel task (forward)
constexpr int64_t kMinChunk = 32;     // tokens per query-gradient partial sum, at least
constexpr int64_t kMaxChunks = 64;    // partial sums, at most

// Token chunks of the query-gradient reduction: a function of N only (never of the thread count).
int64_t chunk_size(int64_t N) {
  return std::max(kMinChunk, (N + kMaxChunks - 1) / kMaxChunks);
}

// Runs body(n0, n1, dw_partial) over fixed token chunks in parallel, then sums the [width] fp32
// partials in chunk order into a fresh tensor.
template <typename Body>
Tensor chunked_with_dw(int64_t N, int64_t width, const Body& body) {
  const int64_t chunk = chunk_size(N);
  const int64_t n_chunks = std::max<int64_t>(1, (N + chunk - 1) / chunk);
  std::vector<float> partial(n_chunks * width, 0.0f);
  at::parallel_for(0, n_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      body(c * chunk, std::min(N, (c + 1) * chunk), partial.data() + c * width);
    }
  });
  Tensor dw = at::zeros({width}, at::kFloat);
  float* out = dw.data_ptr<float>();
  for (int64_t c = 0; c < n_chunks; ++c) {
    const float* part = partial.data() + c * width;
    for (int64_t k = 0; k < width; ++k) out[k] += part[k];
  }
  return dw;
}

void check_rows(const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(t.sizes() == like.sizes(), name, ": shape ", t.sizes(), " != ", like.sizes());
  TORCH_CHECK(t.is_contiguous(), name, ": must be contiguous");
}

void check_dtype(at::ScalarType dt) {
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "AttnRes CPU kernels: fp32, bf16 or fp16 sources, got ", dt);
}

std::tuple<std::vector<Tensor>, std::vector<Tensor>, Tensor, Tensor, Tensor> read_forward(
    std::vector<Tensor> sources, const Tensor& w, double eps, bool save) {
  TORCH_CHECK(!sources.empty(), "read_forward: no sources");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "read_forward: queries must be contiguous fp32 [S, d]");
  const Tensor& s0 = sources[0];
  const auto dt = s0.scalar_type();
  check_dtype(dt);
  const int64_t m = sources.size(), S = w.size(0), d = w.size(1);
  TORCH_CHECK(s0.dim() >= 1 && s0.size(-1) == d, "read_forward: sources' last dim != ", d);
  const int64_t N = s0.numel() / d;
  std::vector<const void*> src(m);
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(sources[i].scalar_type() == dt, "read_forward: sources of one dtype");
    check_rows(sources[i], s0, "read_forward source");
    src[i] = sources[i].data_ptr();
  }
  auto opts = s0.options().dtype(at::kFloat);
  auto shape = s0.sizes().vec();
  auto token_shape = std::vector<int64_t>(shape.begin(), shape.end() - 1);
  std::vector<Tensor> out(S), lse(S);
  std::vector<void*> out_p(S);
  std::vector<float*> lse_p(S);
  for (int64_t s = 0; s < S; ++s) {
    out[s] = at::empty(shape, s0.options());
    lse[s] = at::empty(token_shape, opts);
    out_p[s] = out[s].data_ptr();
    lse_p[s] = lse[s].data_ptr<float>();
  }
  Tensor r = at::empty({save ? N : 0, m}, opts);
  Tensor z = at::empty({save ? N : 0, S, m}, opts);
  Tensor a = at::empty({save ? N : 0, S, m}, opts);
  ReadArgs p{src.data(), m, S, d, w.data_ptr<float>(), static_cast<float>(eps), out_p.data(),
             lse_p.data(), save ? r.data_ptr<float>() : nullptr,
             save ? z.data_ptr<float>() : nullptr, save ? a.data_ptr<float>() : nullptr};
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    if (dt == at::kFloat) {
      read_forward_f32(p, n0, n1);
    } else if (dt == at::kBFloat16) {
      read_forward_bf16(p, n0, n1);
    } else {
      read_forward_f16(p, n0, n1);
    }
  });
  return {out, lse, r, z, a};
}

std::tuple<std::vector<Tensor>, Tensor> read_backward(
    std::vector<Tensor> sources, const Tensor& w, const Tensor& r, const Tensor& z,
    const Tensor& a, c10::List<std::optional<Tensor>> d_out,
    c10::List<std::optional<Tensor>> d_lse, c10::List<std::optional<Tensor>> d_up) {
  const Tensor& s0 = sources[0];
  const auto dt = s0.scalar_type();
  check_dtype(dt);
  const int64_t m = sources.size(), S = w.size(0), d = w.size(1);
  const int64_t N = s0.numel() / d;
  TORCH_CHECK(static_cast<int64_t>(d_out.size()) == S && static_cast<int64_t>(d_lse.size()) == S,
              "read_backward: one d_out and d_lse per query");
  TORCH_CHECK(r.numel() == N * m && z.numel() == N * S * m && a.numel() == N * S * m,
              "read_backward: saved scalars do not match");
  TORCH_CHECK(d_up.empty() || static_cast<int64_t>(d_up.size()) == m,
              "read_backward: one chained gradient (or None) per source, or none");
  std::vector<const void*> src(m), up_p(m, nullptr);
  std::vector<void*> dsrc_p(m);
  std::vector<Tensor> d_src(m), keep;
  for (int64_t i = 0; i < m; ++i) {
    check_rows(sources[i], s0, "read_backward source");
    src[i] = sources[i].data_ptr();
    d_src[i] = at::empty_like(sources[i]);
    dsrc_p[i] = d_src[i].data_ptr();
    std::optional<Tensor> up = d_up.empty() ? std::nullopt : d_up.get(i);
    if (up.has_value() && up->defined()) {
      keep.push_back(up->to(dt).contiguous());
      check_rows(keep.back(), s0, "read_backward d_up");
      up_p[i] = keep.back().data_ptr();
    }
  }
  std::vector<const void*> dout_p(S, nullptr);
  std::vector<const float*> dlse_p(S, nullptr);
  auto token_shape = std::vector<int64_t>(s0.sizes().begin(), s0.sizes().end() - 1);
  for (int64_t s = 0; s < S; ++s) {
    std::optional<Tensor> g = d_out.get(s);
    if (g.has_value() && g->defined()) {  // the outputs' (= sources') dtype: no copy
      keep.push_back(g->to(dt).contiguous());
      check_rows(keep.back(), s0, "read_backward d_out");
      dout_p[s] = keep.back().data_ptr();
    }
    std::optional<Tensor> gl = d_lse.get(s);
    if (gl.has_value() && gl->defined()) {
      keep.push_back(gl->to(at::kFloat).contiguous());
      TORCH_CHECK(keep.back().sizes() == at::IntArrayRef(token_shape), "read_backward: d_lse shape");
      dlse_p[s] = keep.back().data_ptr<float>();
    }
  }
  ReadGradArgs p{src.data(), m, S, d, w.data_ptr<float>(), r.data_ptr<float>(),
                 z.data_ptr<float>(), a.data_ptr<float>(), dout_p.data(), dlse_p.data(),
                 up_p.data(), dsrc_p.data()};
  Tensor dw = chunked_with_dw(N, S * d, [&](int64_t n0, int64_t n1, float* part) {
    if (dt == at::kFloat) {
      read_backward_f32(p, n0, n1, part);
    } else if (dt == at::kBFloat16) {
      read_backward_bf16(p, n0, n1, part);
    } else {
      read_backward_f16(p, n0, n1, part);
    }
  });
  return {d_src, dw.view({S, d})};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> merge_forward(const Tensor& o, const Tensor& lse,
                                                         const Tensor& partial, const Tensor& w,
                                                         double eps, bool save) {
  const auto dt = partial.scalar_type();
  check_dtype(dt);
  const bool o32 = o.scalar_type() == at::kFloat;
  TORCH_CHECK((o32 || o.scalar_type() == dt) && lse.scalar_type() == at::kFloat &&
                  w.scalar_type() == at::kFloat,
              "merge_forward: phase-1 output in fp32 or the partial sum's dtype, fp32 lse and query");
  check_rows(o, partial, "merge_forward inter_out");
  check_rows(partial, partial, "merge_forward partial");
  const int64_t d = partial.size(-1), N = partial.numel() / d;
  TORCH_CHECK(lse.numel() == N && lse.is_contiguous() && w.numel() == d && w.is_contiguous(),
              "merge_forward: lse [N] and query [d]");
  auto opts = lse.options();
  Tensor h = at::empty_like(partial);
  Tensor alpha = at::empty({save ? N : 0}, opts), z = at::empty({save ? N : 0}, opts),
         r = at::empty({save ? N : 0}, opts);
  MergeArgs q{o.data_ptr(), lse.data_ptr<float>(), partial.data_ptr(), w.data_ptr<float>(),
              d, static_cast<float>(eps), h.data_ptr(),
              save ? alpha.data_ptr<float>() : nullptr, save ? z.data_ptr<float>() : nullptr,
              save ? r.data_ptr<float>() : nullptr};
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    if (dt == at::kFloat) {
      merge_forward_f32(q, n0, n1);
    } else if (dt == at::kBFloat16) {
      o32 ? merge_forward_bf16_o32(q, n0, n1) : merge_forward_bf16(q, n0, n1);
    } else {
      o32 ? merge_forward_f16_o32(q, n0, n1) : merge_forward_f16(q, n0, n1);
    }
  });
  return {h, alpha, z, r};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> merge_backward(const Tensor& o, const Tensor& partial,
                                                          const Tensor& w, const Tensor& alpha,
                                                          const Tensor& z, const Tensor& r,
                                                          const Tensor& dh_in,
                                                          const std::optional<Tensor>& d_up_in) {
  const auto dt = partial.scalar_type();
  check_dtype(dt);
  const int64_t d = partial.size(-1), N = partial.numel() / d;
  TORCH_CHECK(alpha.numel() == N && z.numel() == N && r.numel() == N,
              "merge_backward: saved scalars do not match");
  const bool o32 = o.scalar_type() == at::kFloat;
  TORCH_CHECK(o32 || o.scalar_type() == dt,
              "merge_backward: phase-1 output in fp32 or the partial sum's dtype");
  check_rows(o, partial, "merge_backward inter_out");
  Tensor dh = dh_in.to(dt).contiguous();
  check_rows(dh, partial, "merge_backward dh");
  Tensor d_up;
  if (d_up_in.has_value() && d_up_in->defined()) {
    d_up = d_up_in->to(dt).contiguous();
    check_rows(d_up, partial, "merge_backward d_up");
  }
  Tensor d_o = at::empty_like(o);
  Tensor d_lse = at::empty(alpha.sizes(), alpha.options());
  Tensor d_p = at::empty_like(partial);
  MergeGradArgs q{o.data_ptr(), partial.data_ptr(), w.data_ptr<float>(),
                  alpha.data_ptr<float>(), z.data_ptr<float>(), r.data_ptr<float>(),
                  dh.data_ptr(), d_up.defined() ? d_up.data_ptr() : nullptr, d,
                  d_o.data_ptr(), d_lse.data_ptr<float>(), d_p.data_ptr()};
  Tensor dw = chunked_with_dw(N, d, [&](int64_t n0, int64_t n1, float* part) {
    if (dt == at::kFloat) {
      merge_backward_f32(q, n0, n1, part);
    } else if (dt == at::kBFloat16) {
      o32 ? merge_backward_bf16_o32(q, n0, n1, part) : merge_backward_bf16(q, n0, n1, part);
    } else {
      o32 ? merge_backward_f16_o32(q, n0, n1, part) : merge_backward_f16(q, n0, n1, part);
    }
  });
  return {d_o, d_lse, d_p, dw};
}

}  // namespace

TORCH_LIBRARY(depthscale_attnres, m) {
  m.def("read_forward", &read_forward);
  m.def("read_backward", &read_backward);
  m.def("merge_forward", &merge_forward);
  m.def("merge_backward", &merge_backward);
}
