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

// ---- accesses for data streamed once ---------------------------------------------------------
// An L2 cache policy that marks lines evict-first. Not volatile: the compiler may share one
// instance between the accesses of a thread.
FI_DEVICE uint64_t l2_evict_first_policy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// 16-byte load / store without L1 allocation under the evict-first L2 policy, for data read or
// written once (an in-place pass over a large tensor): written lines leave L2 early instead of
// piling up as dirty lines (RoPE's cos/sin-cache kernel, session 42: x1.015 from the stores;
// RMSNorm's row stores measured x0.998-1.001, so not used there).
// Coherent accesses (no .nc), so in-place callers stay correct.
FI_DEVICE uint4 load16_evict_first(const void* ptr) {
  uint4 r;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr), "l"(l2_evict_first_policy()));
  return r;
}

FI_DEVICE void store16_evict_first(void* ptr, uint4 v) {
  asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;"
               ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(l2_evict_first_policy()) : "memory");
}

// 16-byte load of data read once that other threads of the CTA read around it in the same pass
// (weight streaming): non-coherent, no L1 allocation, L2 fetching the 128 bytes around a miss.
// Only for data no kernel writes while it runs.
FI_DEVICE uint4 load16_stream(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// Elements of T in one 16-byte access.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

// Whether a pointer is aligned for an access of `bytes`.
FI_HOST_DEVICE bool is_aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

}  // namespace fi
