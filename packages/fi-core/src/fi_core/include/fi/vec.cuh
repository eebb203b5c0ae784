// Vector types for 16-byte global loads/stores and element conversions to/from float.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fi/common.cuh"

namespace fi {

// ---- scalar conversions ---------------------------------------------------------------------
template <typename T> FI_HOST_DEVICE float to_float(T x);
template <> FI_HOST_DEVICE float to_float<float>(float x) { return x; }
template <> FI_HOST_DEVICE float to_float<__half>(__half x) { return __half2float(x); }
template <> FI_HOST_DEVICE float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> FI_HOST_DEVICE float to_float<__nv_fp8_e4m3>(__nv_fp8_e4m3 x) { return float(x); }
template <> FI_HOST_DEVICE float to_float<__nv_fp8_e5m2>(__nv_fp8_e5m2 x) { return float(x); }

template <typename T> FI_HOST_DEVICE T from_float(float x);
template <> FI_HOST_DEVICE float from_float<float>(float x) { return x; }
template <> FI_HOST_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> FI_HOST_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> FI_HOST_DEVICE __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) { return __nv_fp8_e4m3(x); }
template <> FI_HOST_DEVICE __nv_fp8_e5m2 from_float<__nv_fp8_e5m2>(float x) { return __nv_fp8_e5m2(x); }

// ---- vec_t: N elements of T held in registers, moved as one aligned access -------------------
// Use N * sizeof(T) == 16 for the widest (LDG.128) access; the pointer must be aligned to that.
template <typename T, int N>
struct alignas(sizeof(T) * N) vec_t {
  T data[N];

  FI_DEVICE T& operator[](int i) { return data[i]; }
  FI_DEVICE const T& operator[](int i) const { return data[i]; }

  FI_DEVICE void load(const T* ptr) { *this = *reinterpret_cast<const vec_t*>(ptr); }
  FI_DEVICE void store(T* ptr) const { *reinterpret_cast<vec_t*>(ptr) = *this; }

  // Streaming load that skips L1 allocation: data read once (KV cache, weights).
  FI_DEVICE void load_nc(const T* ptr) {
    static_assert(sizeof(vec_t) == 16 || sizeof(vec_t) == 8 || sizeof(vec_t) == 4, "size");
    if constexpr (sizeof(vec_t) == 16) {
      int4 v = __ldg(reinterpret_cast<const int4*>(ptr));
      *reinterpret_cast<int4*>(this) = v;
    } else if constexpr (sizeof(vec_t) == 8) {
      int2 v = __ldg(reinterpret_cast<const int2*>(ptr));
      *reinterpret_cast<int2*>(this) = v;
    } else {
      int v = __ldg(reinterpret_cast<const int*>(ptr));
      *reinterpret_cast<int*>(this) = v;
    }
  }

  FI_DEVICE void fill(T v) {
#pragma unroll
    for (int i = 0; i < N; ++i) data[i] = v;
  }

  FI_DEVICE void to_float(float (&out)[N]) const {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = fi::to_float(data[i]);
  }

  FI_DEVICE void from_float(const float (&in)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) data[i] = fi::from_float<T>(in[i]);
  }
};

// Elements of T in one 16-byte access.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

// Whether a pointer is aligned for an access of `bytes`.
FI_HOST_DEVICE bool is_aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

}  // namespace fi
