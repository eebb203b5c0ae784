// FP4 (e2m1) block-scaled rows -> bfloat16: out[r, k] = code(r, k) * scale(r, k / block).
//
// mm_fp4 on GPUs without FP4 tensor cores (Hopper, Ada, Ampere): both operands go through this
// kernel and then through fi-gemm's bf16 GEMM. code * scale is exact in bf16 (a 2-bit
// significand times the e4m3 scale's 4 bits, or times a power of two for UE8M0), so the result
// differs from an FP4 tensor-core GEMM only in the order of the fp32 accumulation.
//
// Bandwidth-bound: a thread turns 8 packed bytes (16 codes: one 16-element NVFP4 block, half an
// MXFP4 block) into 32 bytes of bf16, with one 8-byte load, one scale byte and two 16-byte
// stores. blockIdx.x walks a row's 16-code groups, blockIdx.y the rows.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "fi/common.cuh"
#include "fp4.cuh"

namespace {

struct Params {
  const uint8_t* q;      // [rows, k / 2] packed codes, row stride ldq bytes
  const uint8_t* sf;     // scale bytes in `layout`
  __nv_bfloat16* out;    // [rows, k], row stride ldo elements
  int64_t rows, groups;  // groups = k / 16 per row
  int64_t ldq, ldo;
  int block_shift;       // log2(block): 4 (NVFP4) or 5 (MXFP4)
  int layout;
  int ue8m0;
  int cols;              // k / block: logical scale columns
  int k_tiles;           // ceil(cols / 4): 4-column tiles of the swizzled layouts
};

FI_DEVICE float decode_scale(uint32_t b, bool ue8m0) {
  if (ue8m0) {  // 2^(b - 127); 0 is the subnormal 2^-127, 255 is NaN
    if (b == 255u) return __uint_as_float(0x7fc00000u);
    return __uint_as_float(b == 0u ? 0x00400000u : b << 23);
  }
  return fi_fp4::e4m3_to_float(b);
}

// e2m1 -> float: magnitudes 0, 0.5 (exponent field 0) and 2^(e - 1) * (1 + m / 2) for e > 0,
// built from the bits (exponent e + 126, top mantissa bit m) instead of a table lookup.
FI_DEVICE float e2m1_to_float(uint32_t code) {
  const uint32_t em = code & 7u;
  const float mag = em >= 2u ? __uint_as_float((((em >> 1) + 126u) << 23) | ((em & 1u) << 22))
                             : 0.5f * static_cast<float>(em);
  return (code & 8u) ? -mag : mag;
}

__global__ void __launch_bounds__(256) fp4_dequant_kernel(const Params p) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= p.groups) return;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    const uint2 v = *reinterpret_cast<const uint2*>(p.q + r * p.ldq + g * 8);
    const float s = decode_scale(p.sf[fi_fp4::sf_offset(p.layout, r, int((g << 4) >> p.block_shift), p.k_tiles, p.cols)], p.ue8m0 != 0);
    uint32_t words[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t byte = ((j < 4 ? v.x : v.y) >> (8 * (j & 3))) & 0xffu;
      const __nv_bfloat162 h = __floats2bfloat162_rn(e2m1_to_float(byte & 15u) * s, e2m1_to_float(byte >> 4) * s);
      words[j] = *reinterpret_cast<const uint32_t*>(&h);
    }
    uint4* dst = reinterpret_cast<uint4*>(p.out + r * p.ldo + g * 16);
    dst[0] = make_uint4(words[0], words[1], words[2], words[3]);
    dst[1] = make_uint4(words[4], words[5], words[6], words[7]);
  }
}

}  // namespace

// out [rows, k] bf16 (row stride ldo elements, 16-byte aligned rows); q [rows, k / 2] uint8 (row
// stride ldq bytes, 8-byte aligned rows); sf the scale bytes; block 16 or 32; layout 0 (128x4),
// 1 (8x4) or 2 (linear); ue8m0 0 (float8_e4m3fn scales) or 1. k must be a multiple of block.
FI_EXPORT int fi_fp4_dequant(void* out, const void* q, const void* sf, int64_t rows, int64_t k,
                             int64_t ldq, int64_t ldo, int64_t block, int64_t layout, int64_t ue8m0,
                             cudaStream_t stream) {
  if (rows < 0 || k < 0 || (block != 16 && block != 32) || k % block != 0 || layout < 0 || layout > 2 ||
      ldq % 8 != 0 || ldo % 8 != 0 || (reinterpret_cast<uintptr_t>(q) & 7) != 0 ||
      (reinterpret_cast<uintptr_t>(out) & 15) != 0 || k / block > (int64_t(1) << 30))
    return (int)cudaErrorInvalidValue;
  if (rows == 0 || k == 0) return 0;
  Params p{};
  p.q = static_cast<const uint8_t*>(q);
  p.sf = static_cast<const uint8_t*>(sf);
  p.out = static_cast<__nv_bfloat16*>(out);
  p.rows = rows;
  p.groups = k / 16;
  p.ldq = ldq;
  p.ldo = ldo;
  p.block_shift = block == 16 ? 4 : 5;
  p.layout = int(layout);
  p.ue8m0 = int(ue8m0);
  p.cols = int(k / block);
  p.k_tiles = (p.cols + 3) / 4;
  const int64_t gx = (p.groups + 255) / 256;
  if (gx > 0x7fffffff) return (int)cudaErrorInvalidValue;
  const dim3 grid(unsigned(gx), unsigned(rows < 65535 ? rows : 65535));
  fp4_dequant_kernel<<<grid, 256, 0, stream>>>(p);
  return FI_LAUNCH_STATUS();
}
