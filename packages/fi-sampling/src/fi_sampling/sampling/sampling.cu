// Sorting-free sampling from probabilities: plain, top-k, top-p, min-p and joint top-k + top-p.
//
// Exact rejection sampling with a rising pivot. Each round draws one token j by inverse CDF from
// the elements above the pivot `lo` (weights = probabilities, so no renormalisation is needed) and
// accepts it when it lies in the filtered set. A rejected token proves every probability <= p_j
// is outside the set, so the pivot rises to p_j. Because a rejected round already pays for a pass
// over the row, the check evaluates three more pivots between p_j and the smallest known-good
// value `hi` at no extra memory traffic: the bracket shrinks 4x per round, and the next round's
// proposal lands in the set with high probability. Conditioned on acceptance, the token has
// exactly the filtered distribution, whatever the pivots were.
//
// Typical cost: top-p 0.9 = 2 passes (the first proposal is accepted with probability ~0.9),
// min-p = 1-2 passes (the threshold is known after the first pass).
//
// Top-k alone runs one rejection round only. Later rounds cost two passes each and k = 50 of
// a flat 128k row took 5-7 of them (65 us at batch 1, where one block per row makes every pass
// a latency-bound L2 sweep). Round 0 is kept: a draw from the whole row plus its count check
// (2 passes) accepts at once on peaked rows, where the top-k cut is far below the max and value
// bracketing would need many passes. On rejection, its 4 pivot counts seed threshold.cuh's
// bracket (lo, max], which usually already holds <= 256 elements: one gather pass gives the
// exact cut t (ties kept), and one more draw from {x >= t} (1 pass) finishes: ~4-5 passes.
// Exact: P(i) = p_i [first draw = i, i kept] + (1 - P(kept)) p_i / P(kept) = p_i / P(kept).
// sm_90 and later (sm_80 keeps the rejection loop: see the kernel).
#include "fi/common.cuh"
#include "philox.cuh"
#include "rejection.cuh"
#include "row_ops.cuh"
#include "threshold.cuh"

namespace fi::sampling {

template <int kMode>
__global__ void __launch_bounds__(kThreads, 1)
filtered_sampling_kernel(int* __restrict__ out, const float* __restrict__ probs,
                         const int* __restrict__ indices, int64_t num_rows, int64_t vocab,
                         int64_t row_stride, bool vec, const int* __restrict__ top_k_arr,
                         int top_k_val, const float* __restrict__ thr_arr, float thr_val,
                         RngArgs rng) {
  __shared__ SampleSmem sample_sm;
  __shared__ StatsSmem stats_sm;
  const int64_t b = blockIdx.x;
  const int64_t src = indices ? (int64_t)indices[b] : b;
  if (src < 0 || src >= num_rows) {  // a bad index never reads out of bounds
    if (threadIdx.x == 0) out[b] = 0;
    return;
  }
  const float* rp = probs + src * row_stride;
  const Row row{rp, vocab, vec && (reinterpret_cast<uintptr_t>(rp) & 15) == 0};
  uint64_t seed, offset;
  rng.load(b, seed, offset);

  int k = top_k_arr ? top_k_arr[b] : top_k_val;
  if (k <= 0 || k > vocab) k = (int)vocab;  // k <= 0 means no top-k filter
  const float thr = thr_arr ? thr_arr[b] : thr_val;

#if __CUDA_ARCH__ >= 900
  // sm_90+ only: on sm_80 ptxas spills this path under the 64-register cap of 1024-thread blocks
  // (4-16 bytes whatever the arrangement), so sm_80 keeps the plain rejection loop below.
  if constexpr (kMode == kTopK) {
    __shared__ CandSmem cand_sm;
    // Round 0 draws from the whole row; round 1 (only after a rejection) from {x >= cut}. A loop,
    // so sample_above is inlined once (two copies spill under the 64-register cap).
    // Both uniforms up front: seed and offset (4 registers) are then dead inside the loop.
    const float u0 = philox_uniform(seed, offset, (uint32_t)b, 0u);
    const float u1 = philox_uniform(seed, offset, (uint32_t)b, 1u);
    float lo = 0.f;
    int result = 0;  // no positive probability: token 0 (documented)
#pragma unroll 1
    for (int round = 0; round < 2; ++round) {
      const SampleResult s = sample_above(row, lo, round == 0 ? u0 : u1, sample_sm);
      if (s.idx < 0) break;  // round 1 always finds one: the max is >= cut and positive
      result = (int)s.idx;
      if (round == 1) break;
      float piv[kPivots];
      piv[0] = s.val;
#pragma unroll
      for (int j = 1; j < kPivots; ++j) piv[j] = s.val + (s.maxv - s.val) * (j * (1.f / kPivots));
      int cnt[kPivots];
      float mass[kPivots];
      stats_above<true, false>(row, piv, cnt, mass, stats_sm);
      if (cnt[0] < k) break;  // the draw is in the top-k set: accepted
      // The cut lies in (lo, max]: lo = the largest pivot with >= k elements above it.
      lo = piv[0];
      int cnt_lo = cnt[0];
#pragma unroll
      for (int j = 1; j < kPivots; ++j)
        if (cnt[j] >= k && piv[j] > lo) { lo = piv[j]; cnt_lo = cnt[j]; }
      lo = float_below(topk_threshold(row, k, lo, cnt_lo, s.maxv, stats_sm, cand_sm));
    }
    if (threadIdx.x == 0) out[b] = result;
    return;
  }
#endif
  const long long result = rejection_sample<kMode>(row, k, thr, seed, offset, (uint32_t)b,
                                                   sample_sm, stats_sm);
  if (threadIdx.x == 0) out[b] = (int)result;
}

template <int kMode>
int launch(void* out, const void* probs, const void* indices, int64_t batch, int64_t num_rows,
           int64_t vocab, int64_t row_stride, const void* top_k_arr, int32_t top_k_val,
           const void* thr_arr, float thr_val, const void* seed_arr, uint64_t seed,
           int64_t seed_stride, const void* offset_arr, uint64_t offset, int64_t offset_stride,
           cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  const bool vec = vocab % 4 == 0 && row_stride % 4 == 0;
  RngArgs rng{static_cast<const int64_t*>(seed_arr), static_cast<const int64_t*>(offset_arr),
              seed, offset, seed_stride, offset_stride};
  filtered_sampling_kernel<kMode><<<(unsigned)batch, kThreads, 0, stream>>>(
      static_cast<int*>(out), static_cast<const float*>(probs),
      static_cast<const int*>(indices), num_rows, vocab, row_stride, vec,
      static_cast<const int*>(top_k_arr), top_k_val, static_cast<const float*>(thr_arr), thr_val,
      rng);
  return FI_LAUNCH_STATUS();
}

}  // namespace fi::sampling

// mode: 0 plain, 1 top-k, 2 top-p, 3 min-p, 4 joint top-k + top-p. `thr` is top_p or min_p.
// Pointers may be NULL (indices, per-row thresholds, device seed/offset).
FI_EXPORT int fi_sampling_filtered(void* out, const void* probs, const void* indices,
                                   int64_t batch, int64_t num_rows, int64_t vocab,
                                   int64_t row_stride, int32_t mode, const void* top_k_arr,
                                   int32_t top_k_val, const void* thr_arr, float thr_val,
                                   const void* seed_arr, uint64_t seed, int64_t seed_stride,
                                   const void* offset_arr, uint64_t offset, int64_t offset_stride,
                                   cudaStream_t stream) {
  using namespace fi::sampling;
  switch (mode) {
#define FI_CASE(M)                                                                            \
  case M:                                                                                     \
    return launch<M>(out, probs, indices, batch, num_rows, vocab, row_stride, top_k_arr,     \
                     top_k_val, thr_arr, thr_val, seed_arr, seed, seed_stride, offset_arr,   \
                     offset, offset_stride, stream);
    FI_CASE(kPlain)
    FI_CASE(kTopK)
    FI_CASE(kTopP)
    FI_CASE(kMinP)
    FI_CASE(kJoint)
#undef FI_CASE
    default:
      return (int)cudaErrorInvalidValue;
  }
}
