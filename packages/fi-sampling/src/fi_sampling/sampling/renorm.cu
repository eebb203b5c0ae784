// top_k_renorm_probs, top_p_renorm_probs, top_k_mask_logits (exact cut-offs from threshold.cuh,
// then one write pass) and softmax with an optional per-row temperature.
#include "fi/common.cuh"
#include "row_ops.cuh"
#include "threshold.cuh"

namespace fi::sampling {

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
