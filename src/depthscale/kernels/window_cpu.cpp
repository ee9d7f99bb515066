// Causal sliding-window attention on CPU, forward and backward (fp32), registered as
// `depthscale_window::{forward,backward}` and called by model/window_attention.py.
//
// Why not torch's fused flash kernel on tiles: it takes a band only as an additive bias over the
// whole tile, splits queries 32 rows at a time for short tiles, and runs one head at a time, so a
// window of 512 at T = 4096 costs ~0.33 of full causal attention where the arithmetic is ~0.27.
// Here a tile is one KV head's G query heads × `block` query rows (GQA rows stacked, so a GEMM
// has G·block rows while the band wastes only ~block/2 keys per row) against the keys the block
// sees; scores are one GEMM, the band is applied by index (no bias tensor), the softmax and its
// gradient run in one vectorised pass per row, and the gradients' GEMMs accumulate dK, dV in place.
//
// Layout of the work (at::parallel_for; inside a parallel region each GEMM runs on one thread):
// the forward's tasks are tiles; the backward's are runs of a (batch, KV head)'s query blocks,
// each accumulating dK/dV into its own partial, added in run order afterwards: no atomics, and a
// result that does not depend on the thread count (with one task alone the GEMMs may use torch's
// threads). Scores are materialised per tile only: G·block × (block + window − 1) floats, reused.
//
// Tile of rows [i0, i1): keys [k0, i1) with k0 = max(0, i0 − window + 1). Row r = i0 + a sees keys
// [r − window + 1, r], i.e. tile columns [a − off, a + window − off) ∩ [0, nk) where off = k0 −
// (i0 − window + 1) counts the columns clipped at the sequence start.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using at::Tensor;

#include "vec16.h"

constexpr int64_t kParts = 8;
// Runs of query blocks per (batch, KV head) in the backward: up to this many tasks each, at the
// cost of one dK/dV partial per run (about (T/kParts + window) rows).

struct Tile {
  int64_t i0, rows, k0, nk, off;
};

DS_INLINE Tile tile_at(int64_t i0, int64_t T, int64_t window, int64_t block) {
  const int64_t i1 = std::min(T, i0 + block);
  const int64_t unclipped = i0 - window + 1;
  const int64_t k0 = std::max<int64_t>(0, unclipped);
  return {i0, i1 - i0, k0, i1 - k0, k0 - unclipped};
}

// exp(scale·s − shift) over the row's visible columns [lo, hi), zero elsewhere; returns the sum.
// Every argument of exp is ≤ 0 (shift ≥ scale·max), as vexp_nonpositive needs.
DS_CLONES float exp_row(float* s, int64_t nk, int64_t lo, int64_t hi, float scale, float shift) {
  std::fill(s, s + lo, 0.0f);
  std::fill(s + hi, s + nk, 0.0f);
  vec sum = vzero();
  const vec vs = vsplat(scale), vshift = vsplat(shift);
  int64_t j = lo;
  for (; j + kLanes <= hi; j += kLanes) {
    const vec e = vexp_nonpositive(vload(s + j) * vs - vshift);
    vstore(s + j, e);
    sum += e;
  }
  float tail = 0.0f;
  for (; j < hi; ++j) {
    s[j] = std::exp(s[j] * scale - shift);
    tail += s[j];
  }
  return hsum(sum) + tail;
}

DS_CLONES float max_of(const float* s, int64_t lo, int64_t hi) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float top = neg_inf;
  int64_t j = lo;
#if defined(__GNUC__)
  vec lanes = vsplat(neg_inf);
  for (; j + kLanes <= hi; j += kLanes) {
    const vec x = vload(s + j);
    lanes = x > lanes ? x : lanes;
  }
  for (int64_t l = 0; l < kLanes; ++l) top = std::max(top, lanes[l]);
#endif
  for (; j < hi; ++j) top = std::max(top, s[j]);
  return top;
}

// One row of the backward: P = exp(scale·S − lse) in place in s, and dS = P ∘ (dP − delta) · scale
// in place in dp, on [lo, hi); both zero elsewhere.
DS_CLONES void softmax_grad_row(
    float* s, float* dp, int64_t nk, int64_t lo, int64_t hi, float scale, float lse, float delta) {
  std::fill(s, s + lo, 0.0f);
  std::fill(s + hi, s + nk, 0.0f);
  std::fill(dp, dp + lo, 0.0f);
  std::fill(dp + hi, dp + nk, 0.0f);
  const vec vs = vsplat(scale), vl = vsplat(lse), vd = vsplat(delta);
  int64_t j = lo;
  for (; j + kLanes <= hi; j += kLanes) {
    const vec p = vexp_nonpositive(vload(s + j) * vs - vl);
    vstore(s + j, p);
    vstore(dp + j, p * (vload(dp + j) - vd) * vs);
  }
  for (; j < hi; ++j) {
    s[j] = std::exp(s[j] * scale - lse);
    dp[j] = s[j] * (dp[j] - delta) * scale;
  }
}

// The G heads' rows [i0, i0 + rows) of x [H, T, d] (heads h0 .. h0 + G − 1) stacked into buf
// [G·rows, d], or scattered back from it.
void gather_rows(const float* x, float* buf, int64_t h0, int64_t G, int64_t T, int64_t d,
                 int64_t i0, int64_t rows) {
  for (int64_t g = 0; g < G; ++g)
    std::memcpy(buf + g * rows * d, x + ((h0 + g) * T + i0) * d, rows * d * sizeof(float));
}
void scatter_rows(const float* buf, float* x, int64_t h0, int64_t G, int64_t T, int64_t d,
                  int64_t i0, int64_t rows) {
  for (int64_t g = 0; g < G; ++g)
    std::memcpy(x + ((h0 + g) * T + i0) * d, buf + g * rows * d, rows * d * sizeof(float));
}

void check(const Tensor& q, const Tensor& k, const Tensor& v, int64_t window, int64_t block) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "q [B,H,T,d], k/v [B,Hkv,T,d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3) &&
                  q.size(1) % k.size(1) == 0, "q and k/v shapes do not match");
  TORCH_CHECK(q.size(2) >= 1 && window >= 1 && block >= 1,
              "sequence, window and block must be >= 1");
}

std::tuple<Tensor, Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   int64_t window, int64_t block, double scale_) {
  check(q, k, v, window, block);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3), Hkv = k.size(1);
  const int64_t G = H / Hkv, width = std::min(T, block + window - 1);
  const float scale = static_cast<float>(scale_);
  Tensor out = at::empty_like(q);
  Tensor lse = at::empty({B, H, T}, q.options());
  const int64_t nblk = (T + block - 1) / block;
  at::parallel_for(0, B * Hkv * nblk, 1, [&](int64_t begin, int64_t end) {
    // the GEMMs are not differentiated (a thread-local mode: set on every worker thread)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    Tensor qp = at::empty({G * block, d}, q.options());
    Tensor op = at::empty({G * block, d}, q.options());
    Tensor sbuf = at::empty({G * block * width}, q.options());
    std::vector<float> inv(G * block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (Hkv * nblk), hk = task / nblk % Hkv, h0 = hk * G;
      const float* qb = q.data_ptr<float>() + b * H * T * d;
      float* ob = out.data_ptr<float>() + b * H * T * d;
      float* lb = lse.data_ptr<float>() + b * H * T;
      const int64_t i0 = task % nblk * block;
      const Tile t = tile_at(i0, T, window, block);
      const int64_t R = G * t.rows;
      gather_rows(qb, qp.data_ptr<float>(), h0, G, T, d, i0, t.rows);
      Tensor qv = qp.narrow(0, 0, R), ov = op.narrow(0, 0, R);
      Tensor s = sbuf.narrow(0, 0, R * t.nk).view({R, t.nk});
      at::mm_out(s, qv, k[b][hk].narrow(0, t.k0, t.nk).t());
      float* sp = s.data_ptr<float>();
      float* oq = ov.data_ptr<float>();
      for (int64_t r = 0; r < R; ++r) {
        const int64_t a = r % t.rows;
        const int64_t lo = std::max<int64_t>(0, a - t.off), hi = a + window - t.off;
        float* row = sp + r * t.nk;
        const float top = max_of(row, lo, hi) * scale;
        const float total = exp_row(row, t.nk, lo, hi, scale, top);
        inv[r] = 1.0f / total;
        lb[(h0 + r / t.rows) * T + i0 + a] = top + std::log(total);
      }
      at::mm_out(ov, s, v[b][hk].narrow(0, t.k0, t.nk));
      for (int64_t r = 0; r < R; ++r) {
        float* o = oq + r * d;
        for (int64_t j = 0; j < d; ++j) o[j] *= inv[r];
      }
      scatter_rows(oq, ob, h0, G, T, d, i0, t.rows);
    }
  });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                            const Tensor& v, const Tensor& lse,
                                            const Tensor& delta, int64_t window, int64_t block,
                                            double scale_) {
  check(q, k, v, window, block);
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.is_contiguous() && dout.scalar_type() == at::kFloat,
              "dout like q");
  TORCH_CHECK(lse.sizes() == q.sizes().slice(0, 3) && delta.sizes() == lse.sizes() &&
                  lse.is_contiguous() && delta.is_contiguous() &&
                  lse.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat,
              "lse and delta: contiguous fp32 [B, H, T]");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3), Hkv = k.size(1);
  const int64_t G = H / Hkv, width = std::min(T, block + window - 1);
  const float scale = static_cast<float>(scale_);
  Tensor dq = at::empty_like(q);
  Tensor dk = at::zeros_like(k);
  Tensor dv = at::zeros_like(v);
  // A (batch, KV head)'s query blocks in `parts` runs, one task each, with its own dK/dV partial
  // over the keys its blocks see; the partials are added in run order afterwards. The runs depend
  // on the shape only, so the sums (and the result) do not depend on the thread count.
  const int64_t nblk = (T + block - 1) / block;
  const int64_t per_part = (nblk + kParts - 1) / kParts;
  const int64_t parts = (nblk + per_part - 1) / per_part;
  auto key_range = [&](int64_t part) {  // [first key, end key) of the run's tiles
    const Tile first = tile_at(part * per_part * block, T, window, block);
    const int64_t last_i0 = (std::min(nblk, (part + 1) * per_part) - 1) * block;
    const Tile last = tile_at(last_i0, T, window, block);
    return std::make_pair(first.k0, last.i0 + last.rows);
  };
  std::vector<Tensor> pdk(B * Hkv * parts), pdv(B * Hkv * parts);
  at::parallel_for(0, B * Hkv * parts, 1, [&](int64_t begin, int64_t end) {
    // the GEMMs are not differentiated (a thread-local mode: set on every worker thread)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    Tensor qp = at::empty({G * block, d}, q.options());
    Tensor dop = at::empty({G * block, d}, q.options());
    Tensor dqp = at::empty({G * block, d}, q.options());
    Tensor sbuf = at::empty({G * block * width}, q.options());
    Tensor dpbuf = at::empty({G * block * width}, q.options());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (Hkv * parts), hk = task / parts % Hkv, part = task % parts;
      const int64_t h0 = hk * G;
      const float* qb = q.data_ptr<float>() + b * H * T * d;
      const float* db = dout.data_ptr<float>() + b * H * T * d;
      float* dqb = dq.data_ptr<float>() + b * H * T * d;
      const float* lb = lse.data_ptr<float>() + b * H * T;
      const float* deltab = delta.data_ptr<float>() + b * H * T;
      const Tensor kh = k[b][hk], vh = v[b][hk];
      const auto [kstart, kend] = key_range(part);
      Tensor dkp = at::zeros({kend - kstart, d}, q.options());
      Tensor dvp = at::zeros({kend - kstart, d}, q.options());
      const int64_t first = part * per_part, stop = std::min(nblk, first + per_part);
      for (int64_t blk = first; blk < stop; ++blk) {
        const int64_t i0 = blk * block;
        const Tile t = tile_at(i0, T, window, block);
        const int64_t R = G * t.rows;
        gather_rows(qb, qp.data_ptr<float>(), h0, G, T, d, i0, t.rows);
        gather_rows(db, dop.data_ptr<float>(), h0, G, T, d, i0, t.rows);
        Tensor qv = qp.narrow(0, 0, R), dov = dop.narrow(0, 0, R), dqv = dqp.narrow(0, 0, R);
        Tensor p = sbuf.narrow(0, 0, R * t.nk).view({R, t.nk});
        Tensor ds = dpbuf.narrow(0, 0, R * t.nk).view({R, t.nk});
        Tensor kt = kh.narrow(0, t.k0, t.nk), vt = vh.narrow(0, t.k0, t.nk);
        at::mm_out(p, qv, kt.t());
        at::mm_out(ds, dov, vt.t());
        float* pp = p.data_ptr<float>();
        float* dsp = ds.data_ptr<float>();
        for (int64_t r = 0; r < R; ++r) {
          const int64_t a = r % t.rows, h = h0 + r / t.rows;
          const int64_t lo = std::max<int64_t>(0, a - t.off), hi = a + window - t.off;
          softmax_grad_row(pp + r * t.nk, dsp + r * t.nk, t.nk, lo, hi, scale,
                           lb[h * T + i0 + a], deltab[h * T + i0 + a]);
        }
        dvp.narrow(0, t.k0 - kstart, t.nk).addmm_(p.t(), dov);
        dkp.narrow(0, t.k0 - kstart, t.nk).addmm_(ds.t(), qv);
        at::mm_out(dqv, ds, kt);
        scatter_rows(dqv.data_ptr<float>(), dqb, h0, G, T, d, i0, t.rows);
      }
      pdk[task] = dkp;
      pdv[task] = dvp;
    }
  });
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t bh = begin; bh < end; ++bh) {
      for (int64_t part = 0; part < parts; ++part) {
        const auto [kstart, kend] = key_range(part);
        dk[bh / Hkv][bh % Hkv].narrow(0, kstart, kend - kstart).add_(pdk[bh * parts + part]);
        dv[bh / Hkv][bh % Hkv].narrow(0, kstart, kend - kstart).add_(pdv[bh * parts + part]);
      }
    }
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY(depthscale_window, m) {
  m.def("forward", &forward);
  m.def("backward", &backward);
}
