// Warp- and block-level reductions.
#pragma once

#include "fi/common.cuh"

namespace fi {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
FI_DEVICE T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

template <typename T>
FI_DEVICE T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

template <typename T>
FI_DEVICE T warp_min(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds >= 32 values and may be
// reused after the call returns (the trailing barrier protects it).
template <typename T>
FI_DEVICE T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = lane < nwarps ? scratch[lane] : T(0);
  r = warp_sum(r);
  __syncthreads();
  return r;
}

template <typename T>
FI_DEVICE T block_max(T v, T* scratch, T lowest) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = lane < nwarps ? scratch[lane] : lowest;
  r = warp_max(r);
  __syncthreads();
  return r;
}

}  // namespace fi
