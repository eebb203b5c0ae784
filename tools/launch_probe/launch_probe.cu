// Host-cost probe of kernel launches (see README.md): the ctypes call floor (noop), launch floors of an
// empty kernel (<<<>>>, cudaLaunchKernelEx with and without PDL, the driver's cuLaunchKernelEx, other
// parameter sizes) and runtime queries, each callable from Python with (ptr, stream) or n times from C.
#include <cuda_runtime.h>
#include <cuda.h>
#include <stdint.h>
struct Big { int64_t f[48]; };  // a parameter block about decode's Params size
__global__ void empty_kernel(Big p) { if (p.f[0] == 12345 && threadIdx.x == 999) p.f[1] = 1; }
extern "C" int noop(const void* a, cudaStream_t s) { return 0; }
static Big g_big;
extern "C" int launch_plain(const void* a, cudaStream_t s) {
  empty_kernel<<<1, 32, 0, s>>>(g_big);
  return (int)cudaGetLastError();
}
extern "C" int launch_pdl(const void* a, cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1); cfg.blockDim = dim3(32); cfg.dynamicSmemBytes = 0; cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr; cfg.numAttrs = 1;
  cudaError_t e = cudaLaunchKernelEx(&cfg, empty_kernel, g_big);
  if (e) return (int)e;
  return (int)cudaGetLastError();
}
extern "C" int launch_ex_noattr(const void* a, cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1); cfg.blockDim = dim3(32); cfg.stream = s;
  cudaError_t e = cudaLaunchKernelEx(&cfg, empty_kernel, g_big);
  if (e) return (int)e;
  return (int)cudaGetLastError();
}
static CUfunction g_fn = nullptr;
extern "C" int launch_drv(const void* a, cudaStream_t s) {
  if (!g_fn) { if (cudaGetFuncBySymbol(&g_fn, (const void*)empty_kernel)) return 1; }
  CUlaunchConfig cfg = {};
  cfg.gridDimX = 1; cfg.gridDimY = 1; cfg.gridDimZ = 1; cfg.blockDimX = 32; cfg.blockDimY = 1; cfg.blockDimZ = 1;
  cfg.hStream = (CUstream)s;
  CUlaunchAttribute attr[1];
  attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr[0].value.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr; cfg.numAttrs = 1;
  void* params[1] = {(void*)&g_big};
  typedef CUresult (*LaunchEx)(const CUlaunchConfig*, CUfunction, void**, void**); static LaunchEx fn = nullptr;
  if (!fn) {
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuLaunchKernelEx", (void**)&fn, 12000, cudaEnableDefault, &q) || !fn) return 2;
  }
  return (int)fn(&cfg, g_fn, params, nullptr);
}
extern "C" int get_device(const void* a, cudaStream_t s) { int d; return (int)cudaGetDevice(&d); }
extern "C" int last_error(const void* a, cudaStream_t s) { return (int)cudaGetLastError(); }
extern "C" int capture_status(const void* a, cudaStream_t s) {
  cudaStreamCaptureStatus st;
  cudaError_t e = cudaStreamIsCapturing(s, &st);
  return e ? (int)e : (st != cudaStreamCaptureStatusNone ? 1000 : 0);
}
typedef int (*Fn)(const void*, cudaStream_t);
// n calls of one of the above from C: the floor without Python and ctypes
extern "C" int loop(int which, int n, cudaStream_t s) {
  Fn fns[] = {noop, launch_plain, launch_pdl, launch_ex_noattr, launch_drv, get_device, last_error, capture_status};
  Fn f = fns[which];
  int rc = 0;
  for (int i = 0; i < n; ++i) rc |= f(nullptr, s);
  return rc;
}
// kernels of other parameter sizes, PDL launches
struct P8 { int64_t f[1]; };
struct P1k { int64_t f[128]; };
__global__ void empty8(P8 p) { if (p.f[0] == 12345 && threadIdx.x == 999) p.f[0] = 1; }
__global__ void empty1k(P1k p) { if (p.f[0] == 12345 && threadIdx.x == 999) p.f[1] = 1; }
template <typename K, typename P>
static int pdl(K k, const P& p, cudaStream_t s, int smem) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1); cfg.blockDim = dim3(32); cfg.dynamicSmemBytes = smem; cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr; cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, k, p);
}
static P8 g8; static P1k g1k;
extern "C" int loop_sizes(int which, int n, cudaStream_t s) {
  int rc = 0;
  static bool raised = false;
  if (!raised) { cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 110 * 1024); raised = true; }
  for (int i = 0; i < n; ++i) {
    if (which == 0) rc |= pdl(empty8, g8, s, 0);
    else if (which == 1) rc |= pdl(empty_kernel, g_big, s, 0);
    else if (which == 2) rc |= pdl(empty1k, g1k, s, 0);
    else rc |= pdl(empty_kernel, g_big, s, 100 * 1024);
  }
  return rc;
}
typedef int (*Launch1)(const void*);
extern "C" int loop_ptr(void* fn, const void* arg, int n) {
  int rc = 0;
  Launch1 f = (Launch1)fn;
  for (int i = 0; i < n; ++i) rc |= f(arg);
  return rc;
}
