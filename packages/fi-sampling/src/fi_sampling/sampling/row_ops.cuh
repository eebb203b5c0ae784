// Block-wide passes over one row of a [B, V] float32 matrix: the building blocks of every
// sampling kernel. One thread block owns one row; every reduction runs in a fixed order (per-lane
// sums in index order, a butterfly inside the warp, warps in index order), so a row's result is
// bit-identical from run to run: that is what makes sampling deterministic.
#pragma once

#include <math.h>

#include "fi/common.cuh"
#include "fi/reduce.cuh"

namespace fi::sampling {

constexpr int kThreads = 1024;            // one block per row; 32 warps keep enough loads in flight
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;                // float4 loads issued before any is consumed (latency)
constexpr int kChunk = 32 * 4;            // elements one warp covers with one float4 per lane

FI_DEVICE float nan_f() { return __int_as_float(0x7fffffff); }

// A row view. Out-of-range elements read as NaN, which fails every `x > t` test and is ignored by
// fmaxf, so tails need no special casing.
struct Row {
  const float* p;
  int64_t n;
  bool vec;  // 16-byte aligned row start and n % 4 == 0: float4 loads are legal

  FI_DEVICE void load4(int64_t i, float (&v)[4]) const {
    if (vec && i + 4 <= n) {
      const float4 t = __ldg(reinterpret_cast<const float4*>(p + i));
      v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = (i + k < n) ? __ldg(p + i + k) : nan_f();
    }
  }

  FI_DEVICE float at(int64_t i) const { return __ldg(p + i); }
};

// Contiguous range of 128-element chunks owned by warp w: [c0, c1). Contiguous ownership lets the
// sampling pass find the selected token by rescanning one warp's segment only.
FI_DEVICE void warp_segment(int64_t n, int w, int64_t& c0, int64_t& c1) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  c0 = chunks * w / kWarps;
  c1 = chunks * (w + 1) / kWarps;
}

struct SampleResult {
  int64_t idx;   // sampled index, -1 when no element passes the filter
  float val;     // its probability
  float maxv;    // max over the whole row (NaN ignored)
};

struct SampleSmem {
  float wsum[kWarps];
  float wmax[kWarps];
  int sel_warp;
  float sel_target;
  float maxv;
  long long idx;
};

// Inverse-CDF sample from the elements with x > lo, with weights x (no normalisation needed):
// returns the first index j whose running prefix exceeds u * (sum of those elements).
// One full pass plus a rescan of 1/32 of the row by the selected warp. RowT is any view with
// Row's load4/at/n (e.g. the residual max(target - draft, 0) of speculative sampling).
template <typename RowT>
FI_DEVICE SampleResult sample_above(const RowT& row, float lo, float u, SampleSmem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t c0, c1;
  warp_segment(row.n, warp, c0, c1);
  float s = 0.f, m = -INFINITY;
  for (int64_t c = c0; c < c1; c += kUnroll) {
    float v[kUnroll][4];
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
      if (c + r < c1) row.load4((c + r) * kChunk + lane * 4, v[r]);
      else {
#pragma unroll
        for (int k = 0; k < 4; ++k) v[r][k] = nan_f();
      }
    }
#pragma unroll
    for (int r = 0; r < kUnroll; ++r)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        s += v[r][k] > lo ? v[r][k] : 0.f;
        m = fmaxf(m, v[r][k]);
      }
  }
  s = warp_sum(s);
  m = warp_max(m);
  if (lane == 0) { sm.wsum[warp] = s; sm.wmax[warp] = m; }
  __syncthreads();
  if (warp == 0) {
    const float a = sm.wsum[lane];
    float inc = a;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float t = __shfl_up_sync(kFullMask, inc, o);
      if (lane >= o) inc += t;
    }
    float exc = __shfl_up_sync(kFullMask, inc, 1);
    if (lane == 0) exc = 0.f;
    const float total = __shfl_sync(kFullMask, inc, 31);
    const float target = u * total;
    const unsigned hit = __ballot_sync(kFullMask, a > 0.f && exc <= target && target < inc);
    const unsigned pos = __ballot_sync(kFullMask, a > 0.f);
    // Rounding can leave the target past the last warp: take the last warp with mass.
    const int w = hit ? __ffs(hit) - 1 : (pos ? 31 - __clz(pos) : -1);
    const float excw = __shfl_sync(kFullMask, exc, w < 0 ? 0 : w);
    const float mx = warp_max(sm.wmax[lane]);
    if (lane == 0) {
      sm.sel_warp = w;
      sm.sel_target = hit ? target - excw : INFINITY;
      sm.maxv = mx;
      sm.idx = -1;
    }
  }
  __syncthreads();
  const int w = sm.sel_warp;
  if (warp == w) {
    const float t = sm.sel_target;
    warp_segment(row.n, warp, c0, c1);
    float run = 0.f;
    long long last = -1, found = -1;
    // Chunks are loaded kRescan at a time so the dependent scan waits on few L2 round trips.
    constexpr int kRescan = 8;
    for (int64_t c = c0; c < c1 && found < 0; c += kRescan) {
      float v[kRescan][4];
#pragma unroll
      for (int r = 0; r < kRescan; ++r) {
        if (c + r < c1) row.load4((c + r) * kChunk + lane * 4, v[r]);
        else {
#pragma unroll
          for (int k = 0; k < 4; ++k) v[r][k] = nan_f();
        }
      }
#pragma unroll
      for (int r = 0; r < kRescan; ++r) {
        if (found >= 0) break;
        const int64_t base = (c + r) * kChunk + lane * 4;
        float ls = 0.f;
        long long lane_last = -1;
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (v[r][k] > lo) { ls += v[r][k]; lane_last = base + k; }
        float inc = ls;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const float x = __shfl_up_sync(kFullMask, inc, o);
          if (lane >= o) inc += x;
        }
        float exc = __shfl_up_sync(kFullMask, inc, 1);
        if (lane == 0) exc = 0.f;
        const float ctot = __shfl_sync(kFullMask, inc, 31);
        if (run + ctot > t) {
          // Lowest lane whose inclusive prefix crosses; it has positive mass (adding 0 is exact,
          // so a lane with none would have crossed one lane earlier).
          const unsigned cross = __ballot_sync(kFullMask, run + inc > t);
          const int L = __ffs(cross) - 1;
          long long pick = -1;
          if (lane == L) {
            float acc = run + exc;
#pragma unroll
            for (int k = 0; k < 4; ++k)
              if (pick < 0 && v[r][k] > lo) {
                acc += v[r][k];
                if (acc > t) pick = base + k;
              }
            if (pick < 0) pick = lane_last;  // rounding differs from the lane's summed prefix
          }
          found = __shfl_sync(kFullMask, pick, L);
        } else {
          const unsigned has = __ballot_sync(kFullMask, lane_last >= 0);
          if (has) last = __shfl_sync(kFullMask, lane_last, 31 - __clz(has));
          run += ctot;
        }
      }
    }
    if (lane == 0) sm.idx = found >= 0 ? found : last;
  }
  __syncthreads();
  SampleResult r;
  r.idx = sm.idx;
  r.maxv = sm.maxv;
  r.val = r.idx >= 0 ? row.at(r.idx) : 0.f;
  __syncthreads();  // sm is reused by the next pass
  return r;
}

// For 4 pivots: count and mass of the elements with x > pivot[j]. NaN counts nowhere.
constexpr int kPivots = 4;

struct StatsSmem {
  float mass[kPivots][kWarps];
  int cnt[kPivots][kWarps];
  float mass_out[kPivots];
  int cnt_out[kPivots];
};

template <bool kCount, bool kMass, typename RowT>
FI_DEVICE void stats_above(const RowT& row, const float (&piv)[kPivots], int (&cnt)[kPivots],
                           float (&mass)[kPivots], StatsSmem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int c[kPivots];
  float s[kPivots];
#pragma unroll
  for (int j = 0; j < kPivots; ++j) { c[j] = 0; s[j] = 0.f; }
  constexpr int64_t kStep = (int64_t)kThreads * 4;
  for (int64_t base = (int64_t)threadIdx.x * 4; base < row.n; base += kStep * kUnroll) {
    float v[kUnroll][4];
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) row.load4(base + r * kStep, v[r]);
#pragma unroll
    for (int r = 0; r < kUnroll; ++r)
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int j = 0; j < kPivots; ++j) {
          const bool above = v[r][k] > piv[j];
          if (kCount) c[j] += above ? 1 : 0;
          if (kMass) s[j] += above ? v[r][k] : 0.f;
        }
  }
#pragma unroll
  for (int j = 0; j < kPivots; ++j) {
    if (kCount) c[j] = warp_sum(c[j]);
    if (kMass) s[j] = warp_sum(s[j]);
    if (lane == 0) { sm.cnt[j][warp] = c[j]; sm.mass[j][warp] = s[j]; }
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < kPivots; ++j) {
      const int cc = warp_sum(kCount ? sm.cnt[j][lane] : 0);
      const float ss = warp_sum(kMass ? sm.mass[j][lane] : 0.f);
      if (lane == 0) { sm.cnt_out[j] = cc; sm.mass_out[j] = ss; }
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kPivots; ++j) { cnt[j] = sm.cnt_out[j]; mass[j] = sm.mass_out[j]; }
  __syncthreads();
}

// Deterministic block max / sum of a per-thread value.
struct ReduceSmem {
  float w[kWarps];
  float out;
};

FI_DEVICE float block_reduce_max(float v, ReduceSmem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  if (lane == 0) sm.w[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const float r = warp_max(sm.w[lane]);
    if (lane == 0) sm.out = r;
  }
  __syncthreads();
  const float r = sm.out;
  __syncthreads();
  return r;
}

FI_DEVICE float block_reduce_sum(float v, ReduceSmem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) sm.w[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const float r = warp_sum(sm.w[lane]);
    if (lane == 0) sm.out = r;
  }
  __syncthreads();
  const float r = sm.out;
  __syncthreads();
  return r;
}

// Largest float strictly below x (x > 0 finite): turns `x >= t` into `x > below(t)`.
FI_DEVICE float float_below(float x) {
  if (!(x > 0.f)) return x > -INFINITY ? nextafterf(x, -INFINITY) : x;
  return __int_as_float(__float_as_int(x) - 1);
}

}  // namespace fi::sampling
