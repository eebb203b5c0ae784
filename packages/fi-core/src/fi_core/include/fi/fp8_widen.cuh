// Exact widening of packed fp8 (e4m3 / e5m2) values to bf16 / fp16, for kernels that stage fp8
// K/V caches and feed 16-bit tensor-core instructions (fa2's and fa3's prefill, the tensor-core
// decode kernel).
#pragma once

#include <cuda_fp8.h>
#include <stdint.h>

#include "fi/common.cuh"

namespace fi {

// Two fp8 values (bytes 0-1 of w, or bytes 2-3 with kHigh) widened to two 16-bit values (the low
// half holds the lower byte's value), exactly for every finite value: each e4m3 / e5m2 value is
// also a bf16 and an fp16 value.
// - fp16 from e5m2: the byte is the high byte of the fp16 (same exponent width and bias).
// - fp16 from e4m3: the paired conversion (one instruction on sm_89+).
// - bf16: no paired conversion exists, and fp8 -> fp16 -> fp32 -> bf16 costs four conversions per
//   pair on a quarter-rate unit. Instead: prmt in its sign-replicating mode puts each byte in the
//   low byte of its half and the byte's sign in every bit of the high byte; a mask keeps the 7
//   magnitude bits plus one sign bit, which the left shift carries to bit 15. That is a bf16 whose
//   exponent bias is 120 (e4m3) / 112 (e5m2) short; one exact multiply by 2^120 / 2^112 rebiases
//   it (fp8 subnormals enter as bf16 subnormals, which bf16 arithmetic keeps). sm_90 has a bf16x2
//   multiply; sm_80-89 fuse it as a multiply-add of -0 (which keeps the sign of zero).
//   fp8 NaN / Inf (a corrupt cache) widen to finite values on this path.
template <bool kBf16, bool kE5m2, bool kHigh>
FI_DEVICE uint32_t widen_fp8x2(uint32_t w) {
  if constexpr (!kBf16) {
    if constexpr (kE5m2) {
      return __byte_perm(w, 0, kHigh ? 0x3424 : 0x1404);
    } else {
      const __half2_raw hr =
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(kHigh ? w >> 16 : w & 0xffffu), __NV_E4M3);
      return uint32_t(hr.x) | (uint32_t(hr.y) << 16);
    }
  } else {
    uint32_t u;  // (__byte_perm ignores the selectors' sign-replicate bit)
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(u) : "r"(w), "n"(kHigh ? 0xB3A2 : 0x9180));
    const uint32_t mag = kE5m2 ? (u & 0x047F047Fu) << 5 : (u & 0x087F087Fu) << 4;
    const uint32_t rebias = kE5m2 ? 0x77807780u : 0x7B807B80u;  // bf16 2^112 / 2^120
    uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(mag), "r"(rebias));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(mag), "r"(rebias), "r"(0x80008000u));
#endif
    return r;
  }
}

// Eight fp8 values (two words, lowest byte first) widened: one 16-byte chunk of 16-bit values.
template <bool kBf16, bool kE5m2>
FI_DEVICE uint4 widen_fp8x8(uint32_t a, uint32_t b) {
  return make_uint4(widen_fp8x2<kBf16, kE5m2, false>(a), widen_fp8x2<kBf16, kE5m2, true>(a),
                    widen_fp8x2<kBf16, kE5m2, false>(b), widen_fp8x2<kBf16, kE5m2, true>(b));
}

}  // namespace fi
