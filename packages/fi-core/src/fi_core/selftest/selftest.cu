// fi-core's self-test module: proves compile -> cache -> ctypes load -> launch on the current
// stream end to end (`flashinfer show-config --check`), and gives the launch-overhead probe an
// empty kernel.
#include "fi/common.cuh"
#include "fi/vec.cuh"

namespace {

// y[i] = a * x[i] + b for n floats.
__global__ void axpb_kernel(float* __restrict__ y, const float* __restrict__ x, float a, float b,
                            int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    y[i] = fmaf(a, x[i], b);
  }
}

__global__ void noop_kernel() {}

}  // namespace

FI_EXPORT int fi_selftest_axpb(void* y, const void* x, float a, float b, int64_t n,
                               cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t max_blocks = 4LL * fi::sm_count();
  const int64_t blocks = n / threads + 1 < max_blocks ? n / threads + 1 : max_blocks;
  axpb_kernel<<<(unsigned)blocks, threads, 0, stream>>>(static_cast<float*>(y),
                                                        static_cast<const float*>(x), a, b, n);
  return FI_LAUNCH_STATUS();
}

FI_EXPORT int fi_selftest_noop(cudaStream_t stream) {
  noop_kernel<<<1, 32, 0, stream>>>();
  return FI_LAUNCH_STATUS();
}
