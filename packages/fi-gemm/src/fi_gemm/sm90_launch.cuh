// The launch of a CUTLASS sm90 GemmUniversal unit, shared by the dense (gemm_sm90.cu) and
// block-scaled (gemm_blockwise_sm90.cu) units: the caller owns the workspace, nothing is
// allocated, and errors come back as cudaError_t codes (cudaErrorNotSupported: the unit cannot run
// these arguments; cudaErrorInvalidValue: the workspace is too small). Included after the CUTLASS
// headers and fi/common.cuh.
#pragma once

namespace fi_gemm {

template <typename Gemm>
inline int run_unit(const typename Gemm::Arguments& args, void* workspace, int64_t workspace_bytes,
                    cudaStream_t stream) {
  using GemmKernel = typename Gemm::GemmKernel;
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return (int)cudaErrorNotSupported;
  const size_t need = Gemm::get_workspace_size(args);
  if (need > static_cast<size_t>(workspace_bytes)) return (int)cudaErrorInvalidValue;
  if (GemmKernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess)
    return (int)cudaErrorUnknown;
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, workspace);
  FI_TRY(fi::set_max_dynamic_smem(cutlass::device_kernel<GemmKernel>, int(GemmKernel::SharedStorageSize)));
  if (Gemm::run(params, stream) != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();
    return e != cudaSuccess ? (int)e : (int)cudaErrorLaunchFailure;
  }
  return FI_LAUNCH_STATUS();
}

}  // namespace fi_gemm
