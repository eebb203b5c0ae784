// Exact top-k / top-p thresholds without sorting, and the ops built on them: top_k_renorm_probs,
// top_p_renorm_probs, top_k_mask_logits; plus softmax with an optional (per-row) temperature.
//
// The kept set of a row is {x : ok(x)} with ok(v) = count(x > v) < k (top-k) or
// mass(x > v) < p (top-p). ok is monotone in v, so the set is {x >= v*} for the smallest float
// v* with ok(v*). We find v* by a 5-way search over the order-preserving 32-bit key of the float:
// each pass over the row evaluates 4 pivots, so at most ~14 passes pin v* exactly (ties at the
// threshold are all kept, as in FlashInfer). Top-k first narrows the bracket in value space and
// finishes on a small candidate set in shared memory (typically 3-4 passes in all).
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

FI_DEVICE float row_max(const Row& row, ReduceSmem& sm) {
  float m = -INFINITY;
  for (int64_t i = (int64_t)threadIdx.x * 4; i < row.n; i += (int64_t)kThreads * 4) {
    float v[4];
    row.load4(i, v);
#pragma unroll
    for (int q = 0; q < 4; ++q) m = fmaxf(m, v[q]);
  }
  return block_reduce_max(m, sm);
}

// Writes f(x) for each element of the row; `out_vec` says float4 stores are legal.
template <typename F>
FI_DEVICE void row_write(const Row& row, float* out, bool out_vec, F f) {
  for (int64_t i = (int64_t)threadIdx.x * 4; i < row.n; i += (int64_t)kThreads * 4) {
    float v[4];
    row.load4(i, v);
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = f(v[q]);
    if (out_vec && i + 4 <= row.n) {
      *reinterpret_cast<float4*>(out + i) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (i + q < row.n) out[i + q] = v[q];
    }
  }
}

FI_DEVICE bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// mode 0: top-k renorm, 1: top-p renorm (probs); 2: top-k mask (logits, masked -> -inf).
template <int kMode>
__global__ void __launch_bounds__(kThreads, 1)
threshold_kernel(float* __restrict__ out, const float* __restrict__ in, int64_t vocab,
                 int64_t in_stride, int64_t out_stride, bool vec, const int* __restrict__ k_arr,
                 int k_val, const float* __restrict__ p_arr, float p_val) {
  __shared__ StatsSmem stats_sm;
  __shared__ ReduceSmem red_sm;
  __shared__ FirstPassSmem first_sm;
  __shared__ CandSmem cand_sm;
  const int64_t b = blockIdx.x;
  const float* ip = in + b * in_stride;
  float* op = out + b * out_stride;
  const Row row{ip, vocab, vec && aligned16(ip)};
  const bool out_vec = vec && aligned16(op);
  constexpr bool kTopK = kMode != 1;
  int k = k_arr ? k_arr[b] : k_val;
  const float p = p_arr ? p_arr[b] : p_val;
  const bool keep_all = kTopK ? (k <= 0 || k >= vocab) : !(p < 1.f);
  // probs: zeros are never kept unless everything is; logits: -inf never is.
  const float floor = kMode == 2 ? -INFINITY : 0.f;
  const RowStats st = first_pass(row, floor, first_sm);
  float thr = -INFINITY;
  if (!keep_all) {
    if (kTopK) {
      const float lo = kMode == 2 ? float_below(st.minv) : 0.f;
      thr = topk_threshold(row, k, lo, st.above_floor, st.maxv, stats_sm, cand_sm);
    } else {
      thr = key_search<false>(row, k, p, float_key(0.f), float_key(st.maxv), stats_sm);
    }
  }
  if (kMode == 2) {
    row_write(row, op, out_vec, [thr](float x) { return x >= thr ? x : -INFINITY; });
    return;
  }
  float s = 0.f;
  for (int64_t i = (int64_t)threadIdx.x * 4; i < row.n; i += (int64_t)kThreads * 4) {
    float v[4];
    row.load4(i, v);
#pragma unroll
    for (int q = 0; q < 4; ++q) s += (v[q] >= thr && v[q] > 0.f) ? v[q] : 0.f;
  }
  const float sum = block_reduce_sum(s, red_sm);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  row_write(row, op, out_vec,
            [thr, inv](float x) { return (x >= thr && x > 0.f) ? x * inv : 0.f; });
}

// softmax(x / T) per row; T from `temp_arr[b]` when given, else `temp_val`.
__global__ void __launch_bounds__(kThreads, 1)
softmax_kernel(float* __restrict__ out, const float* __restrict__ in, int64_t vocab,
               int64_t in_stride, int64_t out_stride, bool vec, const float* __restrict__ temp_arr,
               float temp_val) {
  __shared__ ReduceSmem red_sm;
  const int64_t b = blockIdx.x;
  const float* ip = in + b * in_stride;
  float* op = out + b * out_stride;
  const Row row{ip, vocab, vec && aligned16(ip)};
  const bool out_vec = vec && aligned16(op);
  const float inv_t = 1.f / (temp_arr ? temp_arr[b] : temp_val);
  // max(x / T) = max(x) / T for T > 0
  const float m = row_max(row, red_sm) * inv_t;
  if (!(m > -INFINITY)) {  // all -inf (or NaN): no distribution; output zeros
    row_write(row, op, out_vec, [](float) { return 0.f; });
    return;
  }
  float s = 0.f;
  for (int64_t i = (int64_t)threadIdx.x * 4; i < row.n; i += (int64_t)kThreads * 4) {
    float v[4];
    row.load4(i, v);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (i + q < row.n) s += expf(fmaf(v[q], inv_t, -m));
  }
  const float inv_sum = 1.f / block_reduce_sum(s, red_sm);
  row_write(row, op, out_vec,
            [m, inv_t, inv_sum](float x) { return expf(fmaf(x, inv_t, -m)) * inv_sum; });
}

}  // namespace fi::sampling

// mode 0: top_k_renorm_probs, 1: top_p_renorm_probs, 2: top_k_mask_logits.
FI_EXPORT int fi_sampling_threshold(void* out, const void* in, int64_t batch, int64_t vocab,
                                    int64_t in_stride, int64_t out_stride, int32_t mode,
                                    const void* k_arr, int32_t k_val, const void* p_arr,
                                    float p_val, cudaStream_t stream) {
  using namespace fi::sampling;
  if (batch <= 0) return cudaSuccess;
  const bool vec = vocab % 4 == 0 && in_stride % 4 == 0 && out_stride % 4 == 0;
  auto o = static_cast<float*>(out);
  auto i = static_cast<const float*>(in);
  auto ka = static_cast<const int*>(k_arr);
  auto pa = static_cast<const float*>(p_arr);
  switch (mode) {
    case 0: threshold_kernel<0><<<(unsigned)batch, kThreads, 0, stream>>>(o, i, vocab, in_stride, out_stride, vec, ka, k_val, pa, p_val); break;
    case 1: threshold_kernel<1><<<(unsigned)batch, kThreads, 0, stream>>>(o, i, vocab, in_stride, out_stride, vec, ka, k_val, pa, p_val); break;
    case 2: threshold_kernel<2><<<(unsigned)batch, kThreads, 0, stream>>>(o, i, vocab, in_stride, out_stride, vec, ka, k_val, pa, p_val); break;
    default: return (int)cudaErrorInvalidValue;
  }
  return FI_LAUNCH_STATUS();
}

FI_EXPORT int fi_sampling_softmax(void* out, const void* in, int64_t batch, int64_t vocab,
                                  int64_t in_stride, int64_t out_stride, const void* temp_arr,
                                  float temp_val, cudaStream_t stream) {
  using namespace fi::sampling;
  if (batch <= 0) return cudaSuccess;
  const bool vec = vocab % 4 == 0 && in_stride % 4 == 0 && out_stride % 4 == 0;
  softmax_kernel<<<(unsigned)batch, kThreads, 0, stream>>>(
      static_cast<float*>(out), static_cast<const float*>(in), vocab, in_stride, out_stride, vec,
      static_cast<const float*>(temp_arr), temp_val);
  return FI_LAUNCH_STATUS();
}
