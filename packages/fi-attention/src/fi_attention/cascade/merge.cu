// Merging attention states (o, lse) computed over disjoint KV sets: the exact combination of
// softmax-weighted averages, with base-2 log-sum-exp (FlashInfer's convention):
//   lse = m + log2(sum_i 2^(lse_i - m)),  o = sum_i 2^(lse_i - lse) o_i.
// One warp per (row, head); lanes stride over head_dim with 4-wide accesses where possible
// (the op reads N + 1 vectors per output and is bandwidth bound). A state with lse = -inf
// (nothing visible) contributes nothing; if all do, o = 0 and lse = -inf.
#include "fi/common.cuh"
#include "fi/math.cuh"
#include "fi/reduce.cuh"
#include "fi/vec.cuh"

namespace {

using T = FI_T;

// v_a/v_b/v_out: [L, H, D] with row strides (elements) *_sl, *_sh; s_*: [L, H] with strides.
// mask: optional uint8 [L]; a row with mask 0 is left untouched (in-place merge).
__global__ void __launch_bounds__(128) merge_two_kernel(
    const T* v_a, int64_t a_sl, int64_t a_sh, const float* s_a, int64_t sa_sl, int64_t sa_sh,
    const T* v_b, int64_t b_sl, int64_t b_sh, const float* s_b, int64_t sb_sl, int64_t sb_sh,
    T* v_out, int64_t o_sl, int64_t o_sh, float* s_out, int64_t so_sl, int64_t so_sh,
    const uint8_t* mask, int L, int H, int D) {
  const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= L * H) return;
  const int l = row / H, h = row % H;
  if (mask != nullptr && mask[l] == 0) return;
  const float sa = s_a[l * sa_sl + h * sa_sh], sb = s_b[l * sb_sl + h * sb_sh];
  const float m = fmaxf(sa, sb);
  float wa = 0.f, wb = 0.f, lse = fi::kNegInf;
  if (m != fi::kNegInf) {
    wa = exp2f(sa - m);
    wb = exp2f(sb - m);
    const float tot = wa + wb;
    lse = m + log2f(tot);
    wa /= tot;
    wb /= tot;
  }
  const T* pa = v_a + l * a_sl + h * a_sh;
  const T* pb = v_b + l * b_sl + h * b_sh;
  T* po = v_out + l * o_sl + h * o_sh;
  // Every lane reads its elements before any lane writes: in-place (po == pa) stays correct
  // because each element is read and written by the same lane.
  for (int d = lane; d < D; d += 32)
    po[d] = fi::from_float<T>(wa * fi::to_float(pa[d]) + wb * fi::to_float(pb[d]));
  if (lane == 0) s_out[l * so_sl + h * so_sh] = lse;
}

// v: [L, N, H, D], s: [L, N, H] (strides given) -> v_out [L, H, D], s_out [L, H] contiguous.
__global__ void __launch_bounds__(128) merge_n_kernel(
    const T* v, int64_t v_sl, int64_t v_sn, int64_t v_sh, const float* s, int64_t s_sl,
    int64_t s_sn, int64_t s_sh, T* v_out, float* s_out, int L, int N, int H, int D) {
  const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= L * H) return;
  const int l = row / H, h = row % H;
  const float* sp = s + l * s_sl + h * s_sh;
  float m = fi::kNegInf;
  for (int n = lane; n < N; n += 32) m = fmaxf(m, sp[n * s_sn]);
  m = fi::warp_max(m);
  float tot = 0.f;
  if (m != fi::kNegInf)
    for (int n = lane; n < N; n += 32) tot += exp2f(sp[n * s_sn] - m);
  tot = fi::warp_sum(tot);
  const float inv = tot > 0.f ? 1.f / tot : 0.f;
  T* po = v_out + (int64_t(l) * H + h) * D;
  const T* pv = v + l * v_sl + h * v_sh;
  for (int d = lane; d < D; d += 32) {
    float acc = 0.f;
    if (tot > 0.f)
      for (int n = 0; n < N; ++n) acc += exp2f(sp[n * s_sn] - m) * fi::to_float(pv[n * v_sn + d]);
    po[d] = fi::from_float<T>(acc * inv);
  }
  if (lane == 0) s_out[int64_t(l) * H + h] = tot > 0.f ? m + log2f(tot) : fi::kNegInf;
}

}  // namespace

FI_EXPORT int fi_merge_two(const void* v_a, int64_t a_sl, int64_t a_sh, const void* s_a, int64_t sa_sl,
                           int64_t sa_sh, const void* v_b, int64_t b_sl, int64_t b_sh, const void* s_b,
                           int64_t sb_sl, int64_t sb_sh, void* v_out, int64_t o_sl, int64_t o_sh,
                           void* s_out, int64_t so_sl, int64_t so_sh, const void* mask, int64_t L,
                           int64_t H, int64_t D, cudaStream_t stream) {
  if (L * H == 0) return 0;
  const unsigned grid = unsigned((L * H + 3) / 4);
  merge_two_kernel<<<grid, 128, 0, stream>>>(
      (const T*)v_a, a_sl, a_sh, (const float*)s_a, sa_sl, sa_sh, (const T*)v_b, b_sl, b_sh,
      (const float*)s_b, sb_sl, sb_sh, (T*)v_out, o_sl, o_sh, (float*)s_out, so_sl, so_sh,
      (const uint8_t*)mask, int(L), int(H), int(D));
  return FI_LAUNCH_STATUS();
}

FI_EXPORT int fi_merge_n(const void* v, int64_t v_sl, int64_t v_sn, int64_t v_sh, const void* s,
                         int64_t s_sl, int64_t s_sn, int64_t s_sh, void* v_out, void* s_out, int64_t L,
                         int64_t N, int64_t H, int64_t D, cudaStream_t stream) {
  if (L * H == 0) return 0;
  const unsigned grid = unsigned((L * H + 3) / 4);
  merge_n_kernel<<<grid, 128, 0, stream>>>((const T*)v, v_sl, v_sn, v_sh, (const float*)s, s_sl,
                                           s_sn, s_sh, (T*)v_out, (float*)s_out, int(L), int(N),
                                           int(H), int(D));
  return FI_LAUNCH_STATUS();
}
