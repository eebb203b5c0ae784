// Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023), one block per request.
//
// Draft token i (proposed with draft prob q) is accepted when u_i * q < p (target prob), i.e. with
// probability min(1, p / q). At the first rejection the replacement token is drawn from the
// residual max(p_i - q_i, 0) (unnormalised: the inverse-CDF pass needs no normalisation, and the
// residual is formed on the fly while streaming both rows); if all n drafts pass, a bonus token is
// drawn from target row n. The output is then distributed exactly as the target model.
#include "fi/common.cuh"
#include "philox.cuh"
#include "row_ops.cuh"

namespace fi::sampling {

// max(t - d, 0) elementwise, NaN outside the row (like Row); d == nullptr reads t alone. One
// row type for all three draws keeps a single copy of sample_above (register budget: 64).
struct ResidualRow {
  const float* t;
  const float* d;
  int64_t n;
  bool vec;

  FI_DEVICE void load4(int64_t i, float (&v)[4]) const {
    if (vec && i + 4 <= n) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(t + i));
      const float4 b = d ? __ldg(reinterpret_cast<const float4*>(d + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
      v[0] = fmaxf(a.x - b.x, 0.f); v[1] = fmaxf(a.y - b.y, 0.f);
      v[2] = fmaxf(a.z - b.z, 0.f); v[3] = fmaxf(a.w - b.w, 0.f);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = (i + k < n) ? at(i + k) : nan_f();
    }
  }
  FI_DEVICE float at(int64_t i) const { return fmaxf(__ldg(t + i) - (d ? __ldg(d + i) : 0.f), 0.f); }
};

FI_DEVICE bool al16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__global__ void __launch_bounds__(kThreads, 1)
chain_speculative_kernel(int* __restrict__ out, int* __restrict__ accepted,
                         int* __restrict__ emitted, const float* __restrict__ draft_probs,
                         const int* __restrict__ draft_ids, const float* __restrict__ target_probs,
                         int n, int64_t vocab, const int64_t* seed_arr, uint64_t seed_val,
                         int64_t seed_stride, const int64_t* offset_arr, uint64_t offset_val,
                         int64_t offset_stride) {
  __shared__ SampleSmem sm;
  const int64_t b = blockIdx.x;
  const uint64_t seed = seed_arr ? (uint64_t)seed_arr[b * seed_stride] : seed_val;
  const uint64_t offset = offset_arr ? (uint64_t)offset_arr[b * offset_stride] : offset_val;
  const bool vec = vocab % 4 == 0;
  int* orow = out + b * (int64_t)(n + 1);
  int n_acc = 0, n_emit = 0;
  int stop = n;  // first rejected position; n: all accepted
  // Draw numbering: 0..n-1 acceptance tests, n..2n-1 replacements, 2n the bonus token.
  for (int i = 0; i < n; ++i) {
    const int tok = draft_ids[b * n + i];
    const bool valid = tok >= 0 && tok < vocab;  // an out-of-range draft id is simply rejected
    const float q = valid ? __ldg(draft_probs + (b * n + i) * vocab + tok) : 0.f;
    const float p = valid ? __ldg(target_probs + (b * (int64_t)(n + 1) + i) * vocab + tok) : 0.f;
    const bool accept = valid && philox_uniform(seed, offset, (uint32_t)b, (uint32_t)i) * q < p;
    n_acc += accept ? 1 : 0;
    if (stop == n && !accept) stop = i;
    if (stop == n && threadIdx.x == 0) orow[i] = tok;
  }
  n_emit = stop;
  // One call site of sample_above (register budget): the residual at the first rejection, or the
  // target row itself for the bonus token and when the residual is empty (target == draft).
  const float* tp = target_probs + (b * (int64_t)(n + 1) + stop) * vocab;
  const float* dp = stop < n ? draft_probs + (b * n + stop) * vocab : nullptr;
  const float u2 = philox_uniform(seed, offset, (uint32_t)b, (uint32_t)(n + stop));
  SampleResult r;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const float* d = attempt == 0 ? dp : nullptr;
    r = sample_above(ResidualRow{tp, d, vocab, vec && al16(tp) && (d == nullptr || al16(d))}, 0.f,
                     u2, sm);
    if (r.idx >= 0 || dp == nullptr) break;
  }
  if (threadIdx.x == 0) orow[stop] = r.idx < 0 ? 0 : (int)r.idx;
  if (threadIdx.x == 0) {
    for (int j = n_emit + 1; j <= n; ++j) orow[j] = -1;
    accepted[b] += n_acc;   // FlashInfer accumulates into the caller's counters
    emitted[b] += n_emit;
  }
}

}  // namespace fi::sampling

FI_EXPORT int fi_chain_speculative_sampling(void* out, void* accepted, void* emitted,
                                            const void* draft_probs, const void* draft_ids,
                                            const void* target_probs, int64_t batch, int32_t n,
                                            int64_t vocab, const void* seed_arr, uint64_t seed,
                                            int64_t seed_stride, const void* offset_arr,
                                            uint64_t offset, int64_t offset_stride,
                                            cudaStream_t stream) {
  using namespace fi::sampling;
  if (batch <= 0) return cudaSuccess;
  chain_speculative_kernel<<<(unsigned)batch, kThreads, 0, stream>>>(
      static_cast<int*>(out), static_cast<int*>(accepted), static_cast<int*>(emitted),
      static_cast<const float*>(draft_probs), static_cast<const int*>(draft_ids),
      static_cast<const float*>(target_probs), n, vocab, static_cast<const int64_t*>(seed_arr),
      seed, seed_stride, static_cast<const int64_t*>(offset_arr), offset, offset_stride);
  return FI_LAUNCH_STATUS();
}
