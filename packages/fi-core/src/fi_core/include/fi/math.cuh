// Fast math used by attention, sampling and norms. Each function says what precision it gives.
#pragma once

#include "fi/common.cuh"

namespace fi {

constexpr float kLog2e = 1.4426950408889634f;   // log2(e)
constexpr float kLn2 = 0.6931471805599453f;     // ln(2)
constexpr float kNegInf = -__builtin_huge_valf();

// 2^x with the SFU (ex2.approx.ftz: ~2 ulp, flushes denormals). Softmax in base 2 uses this.
FI_DEVICE float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) with the SFU (lg2.approx.ftz).
FI_DEVICE float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1/sqrt(x) (rsqrt.approx: ~2 ulp).
FI_DEVICE float rsqrt_approx(float x) { return rsqrtf(x); }

// tanh with the sm_75+ hardware instruction (max rel. error ~2^-11).
FI_DEVICE float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

FI_DEVICE float silu(float x) { return x / (1.0f + __expf(-x)); }

// Exact (erf) GELU.
FI_DEVICE float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }

// GELU with the tanh approximation (the formula, evaluated with accurate tanhf).
FI_DEVICE float gelu_tanh(float x) {
  const float k0 = 0.7978845608028654f;  // sqrt(2/pi)
  const float k1 = 0.044715f;
  return 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x)));
}

}  // namespace fi
