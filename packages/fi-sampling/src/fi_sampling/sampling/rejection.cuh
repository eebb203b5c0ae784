// The rejection loop shared by the sampling kernels (see sampling.cu for the method).
#pragma once

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

// One token from `row` (any view with Row's interface) under filter kMode; k / thr are the row's
// top-k and top-p (or min-p) parameters. Every thread of the block calls it and gets the result.
template <int kMode, typename RowT>
FI_DEVICE long long rejection_sample(const RowT& row, int k, float thr, uint64_t seed,
                                     uint64_t offset, uint32_t stream_row, SampleSmem& sample_sm,
                                     StatsSmem& stats_sm) {
  float lo = 0.f;   // every element <= lo is known to be outside the set (0: zeros never drawn)
  float hi = 0.f;   // smallest pivot known to be inside the set (after round 0)
  float min_p_cut = 0.f;
  long long result = 0;
  for (int round = 0;; ++round) {
    const bool last_round = round == kMaxRounds;
    const float u = philox_uniform(seed, offset, stream_row, (uint32_t)round);
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
  return result;
}

}  // namespace fi::sampling
