// fp4_quantize on the GPU: rows of bf16 / fp16 / fp32 -> packed e2m1 codes and one scale byte per
// block of 16 (NVFP4, float8_e4m3fn scales) or 32 (MXFP4, UE8M0 scales), in one pass.
//
// The arithmetic is the recipe of fi_gemm/fp4/quant.py step by step, each step an IEEE-rounded
// fp32 operation in the same order (no contraction, no approximate reciprocal), so the kernel and
// the torch path give the same bytes; the GPU tests compare them bit for bit.
//
// A thread owns one scale entry of the padded scale buffer: for a real block it reads the block
// (16-byte loads), writes its B / 2 code bytes and its scale byte; for a padding entry of a
// swizzled layout it writes the 0 the layout expects there. Consecutive threads take consecutive
// blocks of a row, so a warp's loads and code stores cover contiguous memory. See kEpt below for
// what limits it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fi/common.cuh"
#include "fi/vec.cuh"
#include "fp4.cuh"

namespace {

struct Params {
  const void* x;         // [rows, k] input, row stride ldx elements, 16-byte aligned rows
  uint8_t* q;            // [rows, k / 2] codes, row stride k / 2 bytes
  uint8_t* sf;           // padded scale buffer, pr x pc bytes
  const float* gs;       // NVFP4 encode scale (one float) or null for 1
  int64_t rows, ldx, half;
  int64_t entries;       // pr * pc
  int pc;                // padded scale columns (= cols for the linear layout)
  int cols;              // k / block
  int layout;
};

FI_DEVICE int64_t sf_offset(const Params& p, int64_t r, int c) {
  return fi_fp4::sf_offset(p.layout, r, c, p.pc >> 2, p.cols);
}

// e2m1 code of y (already on the code grid): the count of thresholds passed, ties to the even
// code (1.0, 2.0 and 4.0 count when reached), saturating at 6; the sign bit of y kept.
FI_DEVICE uint32_t e2m1_code(float y) {
  const float a = fabsf(y);
  const uint32_t c = uint32_t(a > 0.25f) + uint32_t(a >= 0.75f) + uint32_t(a > 1.25f) +
                     uint32_t(a >= 1.75f) + uint32_t(a > 2.5f) + uint32_t(a >= 3.5f) + uint32_t(a > 5.0f);
  return c | ((__float_as_uint(y) >> 28) & 8u);
}

// Scale and codes of the block (r, c) whose B inputs are v, stored.
template <int B, bool UE8M0>
FI_DEVICE void quantize_block(const Params& p, int64_t r, int c, const float* v) {
  float amax = 0.0f;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < B; ++i) {
    const float a = fabsf(v[i]);
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  if (nan) amax = __uint_as_float(0x7fc00000u);
  // amax * (1 / 6): the float nearest 1/6, a multiplication (quant.py does the same).
  const float want = __fmul_rn(amax, 1.0f / 6.0f);
  uint32_t byte;
  float mult;
  if (UE8M0) {
    // 2^ceil(log2(want)), exactly: frexp's exponent, one less when want is a power of two;
    // clamped to UE8M0's 2^-127 .. 2^127; 0 -> 2^-127; NaN -> 255.
    int ex;
    const float m = frexpf(want, &ex);
    int s = want == 0.0f ? -127 : (m == 0.5f ? ex - 1 : ex);
    if (isinf(want)) s = 127;
    s = s < -127 ? -127 : (s > 127 ? 127 : s);
    byte = nan ? 255u : uint32_t(s + 127);
    // 2^-s from its bits (2^-127 is the subnormal 0x00400000)
    mult = nan ? 0.0f : __uint_as_float(s < 127 ? uint32_t(127 - s) << 23 : 0x00400000u);
  } else {
    const float g = p.gs != nullptr ? *p.gs : 1.0f;
    float t = __fmul_rn(g, want);
    t = t > 448.0f ? 448.0f : (t < -448.0f ? -448.0f : t);  // NaN stays NaN
    // in range now, so saturation changes nothing: the hardware conversion (sm_89+; NOSAT is
    // emulated through fp64)
    byte = __nv_cvt_float_to_fp8(t, __NV_SATFINITE, __NV_E4M3);
    const float qf = fi_fp4::e4m3_to_float(byte);
    mult = qf > 0.0f ? __fdiv_rn(g, qf) : 0.0f;
  }
  uint32_t words[B / 8];
#pragma unroll
  for (int w = 0; w < B / 8; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) word |= e2m1_code(__fmul_rn(v[w * 8 + j], mult)) << (4 * j);
    words[w] = nan ? 0u : word;
  }
  uint8_t* dst = p.q + r * p.half + int64_t(c) * (B / 2);
  if constexpr (B == 16) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
  }
  p.sf[sf_offset(p, r, c)] = uint8_t(byte);
}

// Scale entries per thread: a thread issues the loads of all its blocks (adjacent blocks of a row)
// before it works on the first. 1: the kernel wants the warps, not deeper loads per thread (2 and
// 4 ran x0.74-0.94 and x0.40-0.59 on an H100). At 1.6-2.1 TB/s (H100) the likely limiter is
// instruction issue (an estimate from the SASS, ~20 instructions per element in the compare chain
// of e2m1_code; no profiler here); the code from the float's bits, fewer instructions but a
// branch per element, was slower (x0.86-0.89). Both: benchmarks/experiments/session44_*.
constexpr int kEpt = 1;

template <typename T, int B, bool UE8M0>
__global__ void __launch_bounds__(256) fp4_quantize_kernel(const Params p) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t e0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kEpt;
  float v[kEpt][B];
  int64_t r[kEpt];
  int c[kEpt];
  bool real[kEpt];
#pragma unroll
  for (int j = 0; j < kEpt; ++j) {
    const int64_t e = e0 + j;
    r[j] = e / p.pc;
    c[j] = int(e - r[j] * p.pc);
    real[j] = e < p.entries && r[j] < p.rows && c[j] < p.cols;
    if (real[j]) {
      const T* src = static_cast<const T*>(p.x) + r[j] * p.ldx + int64_t(c[j]) * B;
#pragma unroll
      for (int i = 0; i < B / kVec; ++i) {  // 16-byte loads
        fi::vec_t<T, kVec> w;
        float f[kVec];
        w.load(src + i * kVec);
        w.to_float(f);
#pragma unroll
        for (int t = 0; t < kVec; ++t) v[j][i * kVec + t] = f[t];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kEpt; ++j) {
    if (real[j]) {
      quantize_block<B, UE8M0>(p, r[j], c[j], v[j]);
    } else if (e0 + j < p.entries) {
      p.sf[sf_offset(p, r[j], c[j])] = 0;  // padding of a swizzled layout
    }
  }
}

template <typename T>
int launch(const Params& p, int block, bool ue8m0, cudaStream_t stream) {
  const int64_t blocks = (p.entries + 256 * kEpt - 1) / (256 * kEpt);
  if (blocks > 0x7fffffff) return (int)cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  if (block == 16 && !ue8m0) fp4_quantize_kernel<T, 16, false><<<grid, 256, 0, stream>>>(p);
  else if (block == 16) fp4_quantize_kernel<T, 16, true><<<grid, 256, 0, stream>>>(p);
  else if (!ue8m0) fp4_quantize_kernel<T, 32, false><<<grid, 256, 0, stream>>>(p);
  else fp4_quantize_kernel<T, 32, true><<<grid, 256, 0, stream>>>(p);
  return FI_LAUNCH_STATUS();
}

}  // namespace

// x [rows, k] (dtype 0 bf16, 1 fp16, 2 fp32; row stride ldx elements, 16-byte aligned rows);
// q [rows, k / 2] uint8, contiguous, 16-byte aligned; sf the padded scale buffer of pr x pc bytes
// in `layout` (0 128x4, 1 8x4, 2 linear, where pr = rows and pc = k / block); gs a device float or
// null; block 16 or 32; ue8m0 0 (float8_e4m3fn scales) or 1.
FI_EXPORT int fi_fp4_quantize(void* q, void* sf, const void* x, const void* gs, int64_t rows, int64_t k,
                              int64_t ldx, int64_t pr, int64_t pc, int64_t block, int64_t layout,
                              int64_t ue8m0, int64_t dtype, cudaStream_t stream) {
  const int64_t esize = dtype == 2 ? 4 : 2;
  if (rows < 0 || k < 0 || (block != 16 && block != 32) || k % block != 0 || layout < 0 || layout > 2 ||
      dtype < 0 || dtype > 2 || pr < rows || pc < k / block || (layout != fi_fp4::kSfLinear && pc % 4 != 0) ||
      (ldx * esize) % 16 != 0 || (reinterpret_cast<uintptr_t>(x) & 15) != 0 ||
      (reinterpret_cast<uintptr_t>(q) & 15) != 0 || pc > (int64_t(1) << 30))
    return (int)cudaErrorInvalidValue;
  if (pr == 0 || pc == 0) return 0;
  Params p{};
  p.x = x;
  p.q = static_cast<uint8_t*>(q);
  p.sf = static_cast<uint8_t*>(sf);
  p.gs = static_cast<const float*>(gs);
  p.rows = rows;
  p.ldx = ldx;
  p.half = k / 2;
  p.entries = pr * pc;
  p.pc = int(pc);
  p.cols = int(k / block);
  p.layout = int(layout);
  if (dtype == 0) return launch<__nv_bfloat16>(p, int(block), ue8m0 != 0, stream);
  if (dtype == 1) return launch<__half>(p, int(block), ue8m0 != 0, stream);
  return launch<float>(p, int(block), ue8m0 != 0, stream);
}
