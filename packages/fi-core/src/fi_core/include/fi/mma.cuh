// Warp-level tensor-core building blocks for sm_80+ (mma.sync, ldmatrix). Fragment layouts are
// the PTX ISA's for mma.m16n8k16 with 16-bit inputs and fp32 accumulators:
//   A (16x16, row-major)  a0:(g, 2t..2t+1) a1:(g+8, 2t..) a2:(g, 2t+8..) a3:(g+8, 2t+8..)
//   B (16x8, "col")       b0:(k=2t..2t+1, n=g) b1:(k=2t+8.., n=g)
//   C (16x8, fp32)        c0,c1:(g, 2t..2t+1) c2,c3:(g+8, 2t..2t+1)
// with g = lane / 4 and t = lane % 4. ldmatrix.x4 returns four 8x8 matrices whose row addresses
// come from lanes 0-7, 8-15, 16-23, 24-31; each thread receives (row lane/4, cols 2*(lane%4)..+1)
// of every matrix (transposed with .trans), which is exactly the A/B fragment above.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fi/common.cuh"

namespace fi {

// Shared-memory address (32-bit, .shared window) of a generic pointer into shared memory.
FI_DEVICE uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

FI_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

FI_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b for one m16n8k16 tile; T is __nv_bfloat16 or __half (fp32 accumulation).
template <typename T>
FI_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
FI_DEVICE void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
FI_DEVICE void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += A (16x32) * B (32x8) with fp8 inputs (sm_89+; TA / TB: __nv_fp8_e4m3 or __nv_fp8_e5m2, the
// types of A and B) and fp32 accumulators. Four bytes per register: a0:(g, 4t..4t+3)
// a1:(g+8, 4t..) a2:(g, 16+4t..) a3:(g+8, 16+4t..); b0:(k=4t..4t+3, n=g) b1:(k=16+4t.., n=g); C as
// for m16n8k16. Only instantiated by modules built for sm_89 or newer.
template <typename TA, typename TB> struct Mma16832Fp8;
#define FI_MMA_16832_FP8(TA_, TB_, AS, BS)                                                        \
  template <> struct Mma16832Fp8<TA_, TB_> {                                                      \
    static FI_DEVICE void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, \
                              uint32_t b0, uint32_t b1) {                                         \
      asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." AS "." BS                             \
                   ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                 \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                               \
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                       \
    }                                                                                             \
  };
FI_MMA_16832_FP8(__nv_fp8_e4m3, __nv_fp8_e4m3, "e4m3", "e4m3")
FI_MMA_16832_FP8(__nv_fp8_e4m3, __nv_fp8_e5m2, "e4m3", "e5m2")
FI_MMA_16832_FP8(__nv_fp8_e5m2, __nv_fp8_e4m3, "e5m2", "e4m3")
FI_MMA_16832_FP8(__nv_fp8_e5m2, __nv_fp8_e5m2, "e5m2", "e5m2")
#undef FI_MMA_16832_FP8

// Two floats -> one 32-bit register of two 16-bit values (lo in the low half), round to nearest.
template <typename T>
FI_DEVICE uint32_t pack2(float lo, float hi);

template <>
FI_DEVICE uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
FI_DEVICE uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// XOR swizzle for a shared-memory tile whose rows are a multiple of 128 bytes, addressed in
// 16-byte chunks: the chunk index's low 3 bits are XORed with the row's low 3 bits, so the 8 row
// addresses of one ldmatrix phase (same logical chunk, 8 consecutive rows) hit 8 distinct 16-byte
// bank groups (conflict-free), and 16-byte cp.async stores of one row stay contiguous per chunk.
FI_HOST_DEVICE int swizzle_chunk(int row, int chunk) { return chunk ^ (row & 7); }

}  // namespace fi
