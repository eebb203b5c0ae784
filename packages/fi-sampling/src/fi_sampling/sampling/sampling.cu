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
// min-p = 1-2 passes (the threshold is known after the first pass), top-k 50 of 128k = 5-7 passes.
#include "fi/common.cuh"
#include "philox.cuh"
#include "row_ops.cuh"

namespace fi::sampling {

enum Mode : int { kPlain = 0, kTopK = 1, kTopP = 2, kMinP = 3, kJoint = 4 };

// After this many rounds (never reached with finite, non-negative input), sample from the elements
// >= hi, which are all in the filtered set: the output stays valid even for adversarial input.
constexpr int kMaxRounds = 48;

struct RngArgs {
  const int64_t* seed_arr;   // nullable: device seed, read at run time (CUDA-graph capturable)
  const int64_t* offset_arr;
  uint64_t seed;
  uint64_t offset;
  int64_t seed_stride;       // 0: one value for all rows; 1: one per output row
  int64_t offset_stride;

  FI_DEVICE void load(int64_t b, uint64_t& s, uint64_t& o) const {
    s = seed_arr ? (uint64_t)seed_arr[b * seed_stride] : seed;
    o = offset_arr ? (uint64_t)offset_arr[b * offset_stride] : offset;
  }
};

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

  float lo = 0.f;   // every element <= lo is known to be outside the set (0: zeros never drawn)
  float hi = 0.f;   // smallest pivot known to be inside the set (after round 0)
  float min_p_cut = 0.f;
  long long result = 0;
  for (int round = 0;; ++round) {
    const bool last_round = round == kMaxRounds;
    const float u = philox_uniform(seed, offset, (uint32_t)b, (uint32_t)round);
    const SampleResult s = sample_above(row, last_round ? float_below(hi) : lo, u, sample_sm);
    if (s.idx < 0) break;  // no positive probability above the pivot: token 0 (documented)
    result = s.idx;
    if (kMode == kPlain || last_round) break;
    if (round == 0) {
      hi = s.maxv;
      min_p_cut = fminf(fmaxf(thr, 0.f), 1.f) * s.maxv;
    }
    if (kMode == kMinP) {
      if (s.val >= min_p_cut) break;
      lo = float_below(min_p_cut);  // the next proposal is drawn from the set itself
      continue;
    }
    float piv[kPivots];
    piv[0] = s.val;
#pragma unroll
    for (int j = 1; j < kPivots; ++j) piv[j] = s.val + (hi - s.val) * (j * (1.f / kPivots));
    int cnt[kPivots];
    float mass[kPivots];
    stats_above<kMode != kTopP, kMode != kTopK>(row, piv, cnt, mass, stats_sm);
    bool ok[kPivots];
#pragma unroll
    for (int j = 0; j < kPivots; ++j)
      ok[j] = (kMode == kTopP || cnt[j] < k) && (kMode == kTopK || mass[j] < thr);
    if (ok[0]) break;
#pragma unroll
    for (int j = 0; j < kPivots; ++j) {
      if (!ok[j]) lo = fmaxf(lo, piv[j]);
      else hi = fminf(hi, piv[j]);
    }
  }
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
