// Hopper block-scaled FP8 GEMM through CUTLASS 3.x (DeepSeek-style scales):
//   D[m, n] = sum_kb (A[m, kb-block] @ W[n, kb-block]^T) * sfa[kb, m] * sfb[kb, n / 128]
// A [M, K] and W [N, K] K-contiguous fp8; scales fp32 in the "MN-major" layout (sfa [kb, M],
// sfb [kb, ceil(N/128)], both contiguous), the only layout CUTLASS's sm90 blockwise mainloop
// takes. The mainloop promotes the wgmma accumulators into fp32 registers once per 128-wide K
// block, applying both scales there (ScaleGranularityK = 128 = 4 wgmma K steps).
//
// One tile config per unit (FI_TILE_M/N, FI_CLUSTER_M/N, and the persistent scheduler's tile
// order FI_SWIZZLE / FI_RASTER, see sm90_tile_order.cuh); TileK is 128 (one scale block), and TileN
// must be a multiple of 128 (one weight scale per N tile).
// CUTLASS loads sfa with TMA, which needs 16-byte rows of the [kb, M] scale tensor: the row
// stride `ldsfa` (>= M, a multiple of 4) may exceed M, so for M % 4 != 0 the Python side passes a
// copy of the scales padded to ldsfa columns; the padded rows' scales are loaded with the last
// M tile and never reach the output (D stores stop at row M).
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/functional.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include "fi/common.cuh"
#include "../sm90_launch.cuh"
#include "../sm90_tile_order.cuh"

using namespace cute;

// Named (not anonymous) namespace: nvcc's host stub cannot name kernels instantiated on
// anonymous-namespace types. Symbols stay private anyway (-fvisibility=hidden).
namespace fi_blockwise_impl {

using ElementA = FI_TA;
using ElementB = FI_TB;
using ElementD = FI_TD;
constexpr int kAlignA = 16 / sizeof(ElementA);
constexpr int kAlignB = 16 / sizeof(ElementB);
constexpr int kAlignD = 16 / sizeof(ElementD);

using TileShape = Shape<Int<FI_TILE_M>, Int<FI_TILE_N>, _128>;
using ClusterShape = Shape<Int<FI_CLUSTER_M>, Int<FI_CLUSTER_N>, _1>;

using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;  // MN-major both
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor, kAlignD,
    ElementD, cutlass::layout::RowMajor, kAlignD,
    cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, kAlignA,
    ElementB, cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, kAlignB,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue,
    cutlass::gemm::PersistentScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

using StrideA = typename GemmKernel::StrideA;
using StrideB = typename GemmKernel::StrideB;
using StrideC = typename GemmKernel::StrideC;
using StrideD = typename GemmKernel::StrideD;

typename Gemm::Arguments make_args(void* d, const void* a, const void* b, const void* sfa,
                                   const void* sfb, int64_t m, int64_t n, int64_t k,
                                   int64_t lda, int64_t ldb, int64_t ldd, int64_t ldsfa) {
  StrideA sa = make_stride(lda, Int<1>{}, m * lda);
  StrideB sb = make_stride(ldb, Int<1>{}, n * ldb);
  StrideD sd = make_stride(ldd, Int<1>{}, m * ldd);
  auto shape = make_shape(int(m), int(n), int(k), 1);
  auto sf_shape = make_shape(int(ldsfa), int(n), int(k), 1);  // sfa's [kb, ldsfa] layout
  int dev = 0;
  cudaGetDevice(&dev);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = dev;
  hw.sm_count = fi::sm_count();
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {int(m), int(n), int(k), 1},
      {static_cast<const ElementA*>(a), sa, static_cast<const ElementB*>(b), sb,
       static_cast<const float*>(sfa), ScaleConfig::tile_atom_to_shape_SFA(sf_shape),
       static_cast<const float*>(sfb), ScaleConfig::tile_atom_to_shape_SFB(shape)},
      {{}, nullptr, StrideC{}, static_cast<ElementD*>(d), sd},
      hw};
  fi_gemm::set_tile_order(args);
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

}  // namespace fi_blockwise_impl

using namespace fi_blockwise_impl;

FI_EXPORT int fi_gemm_blockwise_sm90_workspace(void* out_bytes, int64_t m, int64_t n, int64_t k) {
  auto args = make_args(nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k, k, k, n, (m + 3) / 4 * 4);
  *static_cast<int64_t*>(out_bytes) = static_cast<int64_t>(Gemm::get_workspace_size(args));
  return 0;
}

// Same contract as fi_gemm_sm90: caller-owned workspace, no allocation, errors as cudaError_t.
FI_EXPORT int fi_gemm_blockwise_sm90(void* d, const void* a, const void* b, const void* sfa,
                                     const void* sfb, int64_t m, int64_t n, int64_t k,
                                     int64_t lda, int64_t ldb, int64_t ldd, int64_t ldsfa,
                                     void* workspace, int64_t workspace_bytes,
                                     cudaStream_t stream) {
  if (m == 0 || n == 0) return 0;
  if (ldsfa < m || ldsfa % 4 != 0) return (int)cudaErrorInvalidValue;
  const auto args = make_args(d, a, b, sfa, sfb, m, n, k, lda, ldb, ldd, ldsfa);
  return fi_gemm::run_unit<Gemm>(args, workspace, workspace_bytes, stream);
}
