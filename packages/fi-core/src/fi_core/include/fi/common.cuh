// Shared basics for every fi kernel module: the export macro, launch-error plumbing, integer math.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>

// Every host launcher is `FI_EXPORT int name(...)` returning a cudaError_t. Modules are built with
// -fvisibility=hidden, so only launchers are visible to the loader.
#define FI_EXPORT extern "C" __attribute__((visibility("default")))

// Return early from a launcher when a CUDA call fails.
#define FI_TRY(expr)                                   \
  do {                                                 \
    cudaError_t fi_err_ = (expr);                      \
    if (fi_err_ != cudaSuccess) return (int)fi_err_;   \
  } while (0)

// Launch status: a launch error (bad config) surfaces here; asynchronous faults surface later.
#define FI_LAUNCH_STATUS() ((int)cudaGetLastError())

#define FI_HOST_DEVICE __host__ __device__ __forceinline__
#define FI_DEVICE __device__ __forceinline__

namespace fi {

template <typename T>
FI_HOST_DEVICE constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

template <typename T>
FI_HOST_DEVICE constexpr T round_up(T a, T b) { return ceil_div(a, b) * b; }

// Kernel attributes (cudaFuncSetAttribute) set once per (kernel, device, attribute, value): setting
// one costs about a microsecond, so launchers call these before every launch and only the first
// call of each kernel on each device pays. A module holds few kernels, so the record is a short
// table under a mutex (uncontended: tens of nanoseconds); past its capacity the attribute is simply
// set again, which is correct, only slower. `at_least`: a recorded value >= `value` also counts
// (a raised limit serves every smaller request).
inline cudaError_t set_attribute_once(const void* fn, cudaFuncAttribute attr, int value, int dev,
                                      bool at_least) {
  struct Set { const void* kernel; int device; cudaFuncAttribute attr; int value; };
  static Set set[64];
  static int count = 0;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < count; ++i)
    if (set[i].kernel == fn && set[i].device == dev && set[i].attr == attr &&
        (at_least ? set[i].value >= value : set[i].value == value))
      return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(fn, attr, value);
  if (err == cudaSuccess && count < 64) set[count++] = {fn, dev, attr, value};
  return err;
}

// Raise a kernel's dynamic shared-memory limit to `bytes` (set_attribute_once). The limit set is at
// least 48 KB: the default is 48 KB minus the kernel's static shared memory (a 48 KB ring beside 16
// bytes of static variables failed to launch with cudaErrorInvalidValue), and a lower one would
// fail other launches of the kernel.
template <typename Kernel>
inline cudaError_t set_max_dynamic_smem(Kernel kernel, int bytes, int dev) {
  if (bytes <= 0) return cudaSuccess;
  bytes = bytes < 48 * 1024 ? 48 * 1024 : bytes;
  return set_attribute_once(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                            bytes, dev, true);
}

// Ask for the largest shared-memory carveout (set_attribute_once), so the CTAs per SM a planner
// counts on (cudaOccupancyMaxActiveBlocksPerMultiprocessor) do not depend on the carveout the driver
// picks after other kernels. The tensor-core decode kernel uses it (decode_common.cuh: the bench's
// b1 row 40.4 -> 37.5 us, session 23); a kernel that leans on L1 may lose by it.
template <typename Kernel>
inline cudaError_t prefer_max_shared_carveout(Kernel kernel, int dev) {
  return set_attribute_once(reinterpret_cast<const void*>(kernel), cudaFuncAttributePreferredSharedMemoryCarveout,
                            int(cudaSharedmemCarveoutMaxShared), dev, false);
}

// The same on the current device. Launchers that make several of these queries per launch read
// the device once (cudaGetDevice, ~40 ns on the H200 host) and pass it to the `dev` forms.
template <typename Kernel>
inline cudaError_t set_max_dynamic_smem(Kernel kernel, int bytes) {
  int dev = 0;
  const cudaError_t err = cudaGetDevice(&dev);
  return err != cudaSuccess ? err : set_max_dynamic_smem(kernel, bytes, dev);
}

// Programmatic dependent launch (PDL; sm_90+, no-ops below). A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may be scheduled before its predecessor in the
// stream has finished: it calls grid_dependency_wait() before its first global memory access,
// which returns once every predecessor grid has completed and its writes are visible. A kernel
// calls launch_dependents() once its CTAs have issued their last loads, so the next grid's launch
// work overlaps its tail.
FI_DEVICE void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
FI_DEVICE void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The SM this thread runs on (%smid) and the number of SM ids (%nsmid: ids lie in [0, nsmid), not
// necessarily all used). Placement-aware scheduling (decode's spread mode) and per-CTA traces.
FI_DEVICE unsigned sm_id() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
FI_DEVICE unsigned sm_id_count() {
  unsigned n;
  asm("mov.u32 %0, %%nsmid;" : "=r"(n));
  return n;
}

// Whether device `dev` has programmatic dependent launch (compute capability 9.0+), read from the
// runtime once per device; pdl_supported() asks about the current device.
inline bool pdl_supported(int dev) {
  static int cached[64] = {0};  // 0: not read yet; else major + 1 (benign race: same value)
  if (dev < 0 || dev >= 64) return false;
  if (cached[dev] == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    cached[dev] = major + 1;
  }
  return cached[dev] - 1 >= 9;
}
inline bool pdl_supported() {
  int dev = 0;
  return cudaGetDevice(&dev) == cudaSuccess && pdl_supported(dev);
}

// kernel<<<grid, block, smem, stream>>>(args...) through cudaLaunchKernelEx with `n` launch
// attributes (the forms below).
template <typename... Params, typename... Args>
inline cudaError_t launch_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             cudaLaunchAttribute* attrs, unsigned n, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization (PDL): the
// grid may start before its predecessor in the stream completes, so the kernel must call
// grid_dependency_wait() before it reads that predecessor's results or writes what it may read.
// Callers check pdl_supported() first (or launch plainly below sm_90).
template <typename... Params, typename... Args>
inline cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                              Args... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return launch_ex(kernel, grid, block, smem, stream, &attr, 1, args...);
}

// The launch attribute of thread-block clusters of `x` CTAs along x (sm_90+).
inline cudaLaunchAttribute cluster_attribute(unsigned x) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = x;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

// kernel<<<grid, block, smem, stream>>>(args...) as clusters of `cluster_x` CTAs along x (grid.x a
// multiple of it).
template <typename... Params, typename... Args>
inline cudaError_t launch_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                  unsigned cluster_x, Args... args) {
  cudaLaunchAttribute attr = cluster_attribute(cluster_x);
  return launch_ex(kernel, grid, block, smem, stream, &attr, 1, args...);
}

// Clusters of `cluster_x` CTAs of `kernel` (block, smem per CTA) that fit the current device at
// once (cudaOccupancyMaxActiveClusters): what a persistent grid of clusters may launch. 0 when none
// fit or the query fails (its error is cleared). Set the kernel's shared-memory limit first.
template <typename... Params>
inline int max_active_clusters(void (*kernel)(Params...), dim3 block, size_t smem, unsigned cluster_x) {
  cudaLaunchAttribute attr = cluster_attribute(cluster_x);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(cluster_x);
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// cudaErrorStreamCaptureUnsupported when `stream` is being captured into a CUDA graph, else
// cudaSuccess (or the query's error): a launcher whose arguments point at buffers that later calls
// replace refuses capture with it before queueing anything. ~60 ns, where torch's Python query
// costs ~330 ns per call on the H200 host (benchmarks/results/h200/hostprobe_session21.json).
// Python sees the code as fi_core.launch.CAPTURE_REFUSED.
inline cudaError_t refuse_capture(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  if (err != cudaSuccess) return err;
  return status == cudaStreamCaptureStatusNone ? cudaSuccess : cudaErrorStreamCaptureUnsupported;
}

// An attribute of device `dev`, read from the runtime once per (attribute, device); `fallback`
// where the runtime reports none. The forms without `dev` ask about the current device.
template <cudaDeviceAttr Attr>
inline int cached_device_attribute(int fallback, int dev) {
  static int cached[64] = {0};
  if (dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, Attr, dev);
    cached[dev] = n > 0 ? n : fallback;
  }
  return cached[dev];
}
template <cudaDeviceAttr Attr>
inline int cached_device_attribute(int fallback) {
  int dev = 0;
  cudaGetDevice(&dev);
  return cached_device_attribute<Attr>(fallback, dev);
}

// Number of SMs of a device (never a literal).
inline int sm_count(int dev) { return cached_device_attribute<cudaDevAttrMultiProcessorCount>(1, dev); }
inline int sm_count() { return cached_device_attribute<cudaDevAttrMultiProcessorCount>(1); }

// Shared memory per SM of a device in bytes (228 KB on sm_90).
inline int smem_per_sm(int dev) {
  return cached_device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(48 * 1024, dev);
}
inline int smem_per_sm() { return cached_device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(48 * 1024); }

// Dynamic shared memory to launch a grid of `grid` CTAs with, each needing `smem` bytes, so that
// the block scheduler puts at most one CTA on an SM: half an SM's shared memory (unused) when the
// grid fits one CTA per SM and the kernel needs less, else `smem`. Without it the scheduler packs
// CTAs two to an SM wherever a slot is free (under PDL the next grid's CTAs fill the slots the
// previous grid leaves) while other SMs idle. Callers raise the kernel's limit to the result
// (set_max_dynamic_smem). `dev` is the device the grid launches on.
inline int one_cta_per_sm_smem(unsigned grid, int smem, int dev) {
  if (grid > unsigned(sm_count(dev))) return smem;
  const int half = smem_per_sm(dev) / 2;
  return half > smem ? half : smem;
}

}  // namespace fi
