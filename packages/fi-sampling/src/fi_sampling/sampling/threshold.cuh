// Exact top-k / top-p cut-offs of a row without sorting (used by renorm.cu and
// sampling_logits.cu).
//
// The kept set of a row is {x : ok(x)} with ok(v) = count(x > v) < k (top-k) or
// mass(x > v) < p (top-p). ok is monotone in v, so the set is {x >= v*} for the smallest float
// v* with ok(v*). key_search finds v* by a 5-way search over the order-preserving 32-bit key of
// the float (<= ~14 passes, exact); topk_threshold first narrows the bracket in value space and
// finishes on a small candidate set in shared memory (typically 3-4 passes in all). Ties at the
// cut-off are all kept, as in FlashInfer.
#pragma once

#include "fi/common.cuh"
#include "row_ops.cuh"

namespace fi::sampling {

// Order-preserving map float -> uint32 (negative floats reversed below the positive ones).
FI_DEVICE uint32_t float_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
FI_DEVICE float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Smallest float v with ok(v), searched over keys in (lo, hi]: `lo` is a key known not to be ok
// (or the bottom of the range of interest), `hi` a key known to be ok. Everything >= v is kept.
template <bool kTopK>
FI_DEVICE float key_search(const Row& row, int k, float p, uint32_t lo, uint32_t hi,
                           StatsSmem& sm) {
  while (hi > lo + 1) {
    float piv[kPivots];
    uint32_t key[kPivots];
#pragma unroll
    for (int j = 0; j < kPivots; ++j) {
      key[j] = lo + (uint32_t)(((uint64_t)(hi - lo) * (j + 1)) / (kPivots + 1));
      piv[j] = key_float(key[j]);
    }
    int cnt[kPivots];
    float mass[kPivots];
    stats_above<kTopK, !kTopK>(row, piv, cnt, mass, sm);
#pragma unroll
    for (int j = 0; j < kPivots; ++j) {
      const bool ok = kTopK ? cnt[j] < k : mass[j] < p;
      if (ok) hi = min(hi, key[j]);
      else lo = max(lo, key[j]);
    }
  }
  return key_float(hi);
}

// Row statistics of the first pass: max, smallest value above -inf, count of values > `floor`.
struct RowStats {
  float maxv, minv;
  int above_floor;
};

struct FirstPassSmem {
  float mx[kWarps], mn[kWarps];
  int cnt[kWarps];
  RowStats out;
};

FI_DEVICE RowStats first_pass(const Row& row, float floor, FirstPassSmem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float mx = -INFINITY, mn = INFINITY;
  int c = 0;
  for (int64_t i = (int64_t)threadIdx.x * 4; i < row.n; i += (int64_t)kThreads * 4) {
    float v[4];
    row.load4(i, v);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      mx = fmaxf(mx, v[q]);
      if (v[q] > -INFINITY) mn = fminf(mn, v[q]);
      c += v[q] > floor ? 1 : 0;
    }
  }
  mx = warp_max(mx);
  mn = warp_min(mn);
  c = warp_sum(c);
  if (lane == 0) { sm.mx[warp] = mx; sm.mn[warp] = mn; sm.cnt[warp] = c; }
  __syncthreads();
  if (warp == 0) {
    const float a = warp_max(sm.mx[lane]);
    const float b = warp_min(sm.mn[lane]);
    const int n = warp_sum(sm.cnt[lane]);
    if (lane == 0) sm.out = RowStats{a, b, n};
  }
  __syncthreads();
  const RowStats r = sm.out;
  __syncthreads();
  return r;
}

// Top-k threshold. A few passes of 4 pivots evenly spaced in value shrink the bracket (lo, hi]
// until it holds <= kCand elements (for k = 50 of 128k logits: ~2 passes); those are gathered
// into shared memory and each one's exact count-above decides the cut, so no key-by-key search
// is needed. Heavy ties or extreme ranges fall back to the exact key search.
constexpr int kCand = 256;         // thread t < m ranks candidate t against all m: O(m) each
constexpr int kValuePasses = 6;

struct CandSmem {
  float val[kCand];
  int n;
  float red[kWarps];
  float out;
};

FI_DEVICE float topk_threshold(const Row& row, int k, float lo, int cnt_lo, float hi,
                               StatsSmem& ssm, CandSmem& csm) {
  int cnt_hi = 0;  // nothing lies above the max
  const bool finite = isfinite(lo) && isfinite(hi);
  for (int pass = 0; finite && pass < kValuePasses && cnt_lo - cnt_hi > kCand; ++pass) {
    float piv[kPivots];
#pragma unroll
    for (int j = 0; j < kPivots; ++j) piv[j] = lo + (hi - lo) * ((j + 1) * (1.f / (kPivots + 1)));
    int cnt[kPivots];
    float mass[kPivots];
    stats_above<true, false>(row, piv, cnt, mass, ssm);
#pragma unroll
    for (int j = 0; j < kPivots; ++j)
      if (cnt[j] >= k && piv[j] > lo) { lo = piv[j]; cnt_lo = cnt[j]; }
#pragma unroll
    for (int j = kPivots - 1; j >= 0; --j)
      if (cnt[j] < k && piv[j] < hi) { hi = piv[j]; cnt_hi = cnt[j]; }
  }
  if (cnt_lo - cnt_hi > kCand) return key_search<true>(row, k, 0.f, float_key(lo), float_key(hi), ssm);
  // Gather the elements in (lo, hi]; the counts above are exact, so at most kCand arrive.
  if (threadIdx.x == 0) csm.n = 0;
  __syncthreads();
  for (int64_t i = (int64_t)threadIdx.x * 4; i < row.n; i += (int64_t)kThreads * 4) {
    float v[4];
    row.load4(i, v);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (v[q] > lo && v[q] <= hi) {
        const int slot = atomicAdd(&csm.n, 1);  // arrival order varies; the result does not
        if (slot < kCand) csm.val[slot] = v[q];
      }
  }
  __syncthreads();
  const int m = min(csm.n, kCand);
  // The cut is the smallest candidate e with count(x > e) < k. The largest candidate always
  // qualifies (count(x > it) = count(x > hi) < k), so an empty result means no candidates.
  float best = INFINITY;
  if (threadIdx.x < m) {
    const float e = csm.val[threadIdx.x];
    int above = cnt_hi;
    for (int c = 0; c < m; ++c) above += csm.val[c] > e ? 1 : 0;
    if (above < k) best = e;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  best = warp_min(best);
  if (lane == 0) csm.red[warp] = best;
  __syncthreads();
  if (warp == 0) {
    const float r = warp_min(csm.red[lane]);
    if (lane == 0) csm.out = r;
  }
  __syncthreads();
  const float r = csm.out;
  __syncthreads();
  return r < INFINITY ? r : hi;
}

}  // namespace fi::sampling
