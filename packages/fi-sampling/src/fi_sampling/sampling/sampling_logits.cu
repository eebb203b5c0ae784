// Sampling from logits in one kernel: sampling_from_logits (kPlain),
// top_k_top_p_sampling_from_logits with filter_apply_order="top_k_first" (kTopP after a top-k cut)
// and "joint" (kJoint on the full softmax).
//
// 1. top_k_first only: the exact top-k cut-off t of the logits (threshold.cuh: ~3-4 passes).
// 2. Z = sum over x >= t of exp(x - max): the renormalised top-k distribution is
//    q(x) = [x >= t] exp(x - max) / Z, never materialised.
// 3. Top-p rejection sampling (rejection.cuh) over q, computed on the fly from the logits.
// No intermediate [B, V] tensor is written; the unfused path (mask, softmax, top-p sampling)
// makes ~10 passes and two full-row writes.
#include "fi/common.cuh"
#include "philox.cuh"
#include "rejection.cuh"
#include "row_ops.cuh"
#include "threshold.cuh"

namespace fi::sampling {

// The renormalised top-k softmax of a logits row. Elements below the cut (and NaN, and the tail
// padding) read as 0, which no filter or sampling pass ever selects.
struct TopKSoftmaxRow {
  Row logits;
  int64_t n;
  float cut, maxv, inv_z;

  FI_DEVICE float f(float x) const { return x >= cut ? __expf(x - maxv) * inv_z : 0.f; }
  FI_DEVICE void load4(int64_t i, float (&v)[4]) const {
    logits.load4(i, v);
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = f(v[q]);
  }
  FI_DEVICE float at(int64_t i) const { return f(logits.at(i)); }
};

template <int kMode>
__global__ void __launch_bounds__(kThreads, 1)
logits_sampling_kernel(int* __restrict__ out, const float* __restrict__ logits,
                          const int* __restrict__ indices, int64_t num_rows, int64_t vocab,
                          int64_t row_stride, bool vec, const int* __restrict__ top_k_arr,
                          int top_k_val, const float* __restrict__ top_p_arr, float top_p_val,
                          RngArgs rng) {
  __shared__ SampleSmem sample_sm;
  __shared__ StatsSmem stats_sm;
  __shared__ FirstPassSmem first_sm;
  __shared__ CandSmem cand_sm;
  __shared__ ReduceSmem red_sm;
  const int64_t b = blockIdx.x;
  const int64_t src = indices ? (int64_t)indices[b] : b;
  if (src < 0 || src >= num_rows) {
    if (threadIdx.x == 0) out[b] = 0;
    return;
  }
  const float* rp = logits + src * row_stride;
  const Row row{rp, vocab, vec && (reinterpret_cast<uintptr_t>(rp) & 15) == 0};
  uint64_t seed, offset;
  rng.load(b, seed, offset);
  int k = top_k_arr ? top_k_arr[b] : top_k_val;
  if (k <= 0 || k > vocab) k = (int)vocab;
  const float top_p = top_p_arr ? top_p_arr[b] : top_p_val;

  const RowStats st = first_pass(row, -INFINITY, first_sm);
  if (!isfinite(st.maxv)) {  // no finite maximum (all -inf / NaN, or +inf): token 0 (documented)
    if (threadIdx.x == 0) out[b] = 0;
    return;
  }
  const float cut = (kMode != kTopP || k >= vocab) ? -INFINITY
                               : topk_threshold(row, k, float_below(st.minv), st.above_floor,
                                         st.maxv, stats_sm, cand_sm);
  float z = 0.f;
  for (int64_t i = (int64_t)threadIdx.x * 4; i < vocab; i += (int64_t)kThreads * 4) {
    float v[4];
    row.load4(i, v);
#pragma unroll
    for (int q = 0; q < 4; ++q) z += v[q] >= cut ? __expf(v[q] - st.maxv) : 0.f;
  }
  z = block_reduce_sum(z, red_sm);  // >= 1: the max itself is kept and contributes exp(0)
  const TopKSoftmaxRow q{row, vocab, cut, st.maxv, 1.f / z};
  const long long result =
      rejection_sample<kMode>(q, k, top_p, seed, offset, (uint32_t)b, sample_sm, stats_sm);
  if (threadIdx.x == 0) out[b] = (int)result;
}

}  // namespace fi::sampling

// mode: 0 plain (sampling_from_logits), 2 top-k first then top-p, 4 joint top-k + top-p.
FI_EXPORT int fi_sampling_from_logits(void* out, const void* logits, const void* indices,
                                      int64_t batch, int64_t num_rows, int64_t vocab,
                                      int64_t row_stride, int32_t mode, const void* top_k_arr,
                                      int32_t top_k_val, const void* top_p_arr,
                                      float top_p_val, const void* seed_arr, uint64_t seed,
                                      int64_t seed_stride, const void* offset_arr,
                                      uint64_t offset, int64_t offset_stride,
                                      cudaStream_t stream) {
  using namespace fi::sampling;
  if (batch <= 0) return cudaSuccess;
  const bool vec = vocab % 4 == 0 && row_stride % 4 == 0;
  RngArgs rng{static_cast<const int64_t*>(seed_arr), static_cast<const int64_t*>(offset_arr),
              seed, offset, seed_stride, offset_stride};
#define FI_LAUNCH(M)                                                                        \
  logits_sampling_kernel<M><<<(unsigned)batch, kThreads, 0, stream>>>(                        \
      static_cast<int*>(out), static_cast<const float*>(logits),                              \
      static_cast<const int*>(indices), num_rows, vocab, row_stride, vec,                     \
      static_cast<const int*>(top_k_arr), top_k_val, static_cast<const float*>(top_p_arr),    \
      top_p_val, rng)
  switch (mode) {
    case kPlain: FI_LAUNCH(kPlain); break;
    case kTopP: FI_LAUNCH(kTopP); break;
    case kJoint: FI_LAUNCH(kJoint); break;
    default: return (int)cudaErrorInvalidValue;
  }
#undef FI_LAUNCH
  return FI_LAUNCH_STATUS();
}
