// Gated activations: out[r, c] = act(in[r, c]) * in[r, d + c] for c < d (SiLU, GELU, GELU-tanh).
//
// Pure streaming: 2 reads + 1 write per output element, no reuse. The (rows x d/VW) vector
// grid is flattened and each thread takes kUnroll vectors a block-width apart, so a warp's
// accesses stay contiguous and every thread has 2 * kUnroll independent 16-byte loads in flight
// before its first use. VW is the widest access that divides d, both row strides and the
// pointer alignment (the up half starts d elements into the row, hence d % VW == 0), so there is
// never a partial vector; odd d runs with 2-byte accesses.
//
// enable_pdl: accepted by the Python API and ignored here (plain stream-ordered launches).
#include "fi/common.cuh"
#include "fi/math.cuh"
#include "fi/vec.cuh"

#ifndef FI_T
#define FI_T __nv_bfloat16
#endif

namespace {

using T = FI_T;
static_assert(sizeof(T) == 2, "activation kernels are instantiated for fp16/bf16");
constexpr int kThreads = 256;
constexpr int kUnroll = 2;

enum Act : int { kSilu = 0, kGelu = 1, kGeluTanh = 2 };

// SiLU with the SFU reciprocal (__fdividef, ~2 ulp): IEEE division is a ~10-instruction
// sequence, and at 117M elements per call that alone would rival the memory time. For
// x << 0, exp(-x) = inf and the quotient is 0, as it should be.
FI_DEVICE float silu_fast(float x) { return __fdividef(x, 1.0f + __expf(-x)); }

// Exact (erf) GELU with erf from Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7 on [0, inf),
// plus ~2 ulp from the SFU reciprocal and exponential, against ~8e-3 / 1e-3 output tolerance in
// bf16 / fp16 (an absolute erf error e moves the output by <= 0.5 |x| e). erff takes two
// polynomial branches (both run in a warp of mixed |x|), ~40 instructions: the kernel became
// issue-bound (211 us against SiLU's 164 us). This is 2 SFU ops + ~10 FMA, branch-free.
// NaN propagates; +inf gives +inf and -inf gives NaN (-inf * 0), as the erff formula did.
FI_DEVICE float gelu_fast(float x) {
  const float z = fabsf(x) * 0.70710678118654752f;
  const float t = __fdividef(1.0f, fmaf(0.3275911f, z, 1.0f));
  float poly = fmaf(1.061405429f, t, -1.453152027f);
  poly = fmaf(poly, t, 1.421413741f);
  poly = fmaf(poly, t, -0.284496736f);
  poly = fmaf(poly, t, 0.254829592f);
  const float erfc_z = poly * t * __expf(-z * z);  // erfc(|x| / sqrt 2)
  // 1 + erf(x / sqrt 2) = 2 - erfc for x >= 0 and erfc(|x| / sqrt 2) for x < 0: no cancellation
  // in the left tail.
  const float one_plus_erf = x >= 0.f ? 2.0f - erfc_z : erfc_z;
  return 0.5f * x * one_plus_erf;
}

template <int ACT>
FI_DEVICE float act(float x) {
  if constexpr (ACT == kSilu) return silu_fast(x);
  else if constexpr (ACT == kGelu) return gelu_fast(x);
  else return fi::gelu_tanh(x);
}

// Vector indices are 32-bit (64-bit division is a slow subroutine); the launcher splits the rows
// into chunks of fewer than 2^31 vectors.
template <int ACT, int VW>
__global__ void __launch_bounds__(kThreads)
act_and_mul_kernel(T* __restrict__ out, const T* __restrict__ in, uint32_t total, uint32_t nvec,
                   int64_t out_s, int64_t in_s, int64_t d) {
  using V = fi::vec_t<T, VW>;
  const uint32_t base = blockIdx.x * (kThreads * kUnroll) + threadIdx.x;
  V g[kUnroll], u[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const uint32_t idx = base + k * kThreads;
    if (idx < total) {
      const uint32_t row = idx / nvec, v = idx - row * nvec;
      const T* src = in + (int64_t)row * in_s + (int64_t)v * VW;
      if constexpr (VW >= 2) {  // read once: skip L1 (vec_t's .nc path needs >= 4 bytes)
        g[k].load_nc(src);
        u[k].load_nc(src + d);
      } else {
        g[k].load(src);
        u[k].load(src + d);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const uint32_t idx = base + k * kThreads;
    if (idx < total) {
      const uint32_t row = idx / nvec, v = idx - row * nvec;
      V o;
#pragma unroll
      for (int j = 0; j < VW; ++j)
        o[j] = fi::from_float<T>(act<ACT>(fi::to_float(g[k][j])) * fi::to_float(u[k][j]));
      o.store(out + (int64_t)row * out_s + (int64_t)v * VW);
    }
  }
}

template <int ACT, int VW>
cudaError_t launch(T* out, const T* in, int64_t rows, int64_t d, int64_t out_s, int64_t in_s,
                   cudaStream_t st) {
  const int64_t nvec = d / VW;
  if (nvec >= (1LL << 31)) return cudaErrorInvalidValue;
  const int64_t chunk = (1LL << 31) / nvec;  // rows per launch: chunk * nvec < 2^31
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = rows - r0 < chunk ? rows - r0 : chunk;
    const int64_t total = n * nvec;
    const int64_t blocks = fi::ceil_div<int64_t>(total, kThreads * kUnroll);
    act_and_mul_kernel<ACT, VW><<<(unsigned)blocks, kThreads, 0, st>>>(
        out + r0 * out_s, in + r0 * in_s, (uint32_t)total, (uint32_t)nvec, out_s, in_s, d);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <int ACT>
cudaError_t launch_vw(int vw, T* out, const T* in, int64_t rows, int64_t d, int64_t out_s,
                      int64_t in_s, cudaStream_t st) {
  switch (vw) {
    case 8: return launch<ACT, 8>(out, in, rows, d, out_s, in_s, st);
    case 4: return launch<ACT, 4>(out, in, rows, d, out_s, in_s, st);
    case 2: return launch<ACT, 2>(out, in, rows, d, out_s, in_s, st);
    default: return launch<ACT, 1>(out, in, rows, d, out_s, in_s, st);
  }
}

}  // namespace

// in: rows of 2*d elements at stride in_s; out: rows of d elements at stride out_s (elements).
// act: 0 = SiLU, 1 = GELU (erf), 2 = GELU (tanh approximation).
FI_EXPORT int fi_act_and_mul(void* out, const void* in, int64_t rows, int64_t d, int64_t out_s,
                             int64_t in_s, int32_t act, cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return cudaSuccess;
  int vw = 16 / (int)sizeof(T);
  while (vw > 1 && !(d % vw == 0 && in_s % vw == 0 && out_s % vw == 0 &&
                     fi::is_aligned(in, vw * (int)sizeof(T)) && fi::is_aligned(out, vw * (int)sizeof(T))))
    vw >>= 1;
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(in);
  switch (act) {
    case kSilu: return (int)launch_vw<kSilu>(vw, o, x, rows, d, out_s, in_s, stream);
    case kGelu: return (int)launch_vw<kGelu>(vw, o, x, rows, d, out_s, in_s, stream);
    case kGeluTanh: return (int)launch_vw<kGeluTanh>(vw, o, x, rows, d, out_s, in_s, stream);
    default: return (int)cudaErrorInvalidValue;
  }
}
