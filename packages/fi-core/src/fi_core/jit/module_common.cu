// Linked into every fi module: lets Python turn a cudaError_t returned by a launcher into the
// runtime's own name and message (each module carries its own static cudart).
#include <cuda_runtime.h>

#define FI_COMMON_EXPORT extern "C" __attribute__((visibility("default")))

FI_COMMON_EXPORT const char* fi_cuda_error_name(int code) {
  return cudaGetErrorName(static_cast<cudaError_t>(code));
}

FI_COMMON_EXPORT const char* fi_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// Bumped when the launcher calling convention changes; the loader refuses a mismatch.
FI_COMMON_EXPORT int fi_module_abi_version() { return 1; }
