// SM -> GPC map of the current GPU, for diagnostics (tools/decode_cta_trace.py --gpc, which builds
// and loads this file as a fi-core module).
//
// CUDA does not name the GPC an SM belongs to, but a thread-block cluster is always placed inside
// one GPC. So launches of many clusters, each CTA recording its %smid and its cluster's index,
// tell which SMs share a GPC: two SMs seen in one cluster share it. The CTAs hold their SM for a
// while (spin on %globaltimer) so a launch's clusters are resident together and land on many
// different SM sets; the caller joins the sets (union-find) over a few launches.
#include "fi/common.cuh"

namespace {

__global__ void gpc_probe_kernel(int* rec, long long spin_ns) {
  unsigned cid;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cid));
  if (threadIdx.x == 0) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long long)(t - t0) < spin_ns);
    rec[2 * blockIdx.x] = int(fi::sm_id());
    rec[2 * blockIdx.x + 1] = int(cid);
  }
}

constexpr int kSmemBytes = 200 * 1024;  // most of an SM's shared memory: one CTA per SM

cudaLaunchConfig_t config(int clusters, int size, cudaLaunchAttribute* attr, cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(clusters * size);
  cfg.blockDim = dim3(32);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = s;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = size;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Clusters above 8 CTAs are non-portable and must be allowed per kernel.
cudaError_t prepare() {
  cudaError_t err = cudaFuncSetAttribute(gpc_probe_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(gpc_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  return err;
}

}  // namespace

// *out: how many clusters of `size` CTAs (one CTA per SM) can be resident at once.
FI_EXPORT int fi_gpc_probe_max_clusters(int size, void* out) {
  if (const cudaError_t err = prepare(); err != cudaSuccess) return int(err);
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = config(1, size, attr, 0);
  return int(cudaOccupancyMaxActiveClusters(static_cast<int*>(out), gpc_probe_kernel, &cfg));
}

// One launch of `clusters` clusters of `size` CTAs; rec holds 2 ints per CTA (smid, cluster index).
FI_EXPORT int fi_gpc_probe_launch(void* rec, int clusters, int size, int64_t spin_ns, cudaStream_t stream) {
  if (const cudaError_t err = prepare(); err != cudaSuccess) return int(err);
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = config(clusters, size, attr, stream);
  return int(cudaLaunchKernelEx(&cfg, gpc_probe_kernel, static_cast<int*>(rec), (long long)spin_ns));
}
