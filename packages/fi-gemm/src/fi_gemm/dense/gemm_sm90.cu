// Hopper GEMM through CUTLASS 3.x: D[l] = (A[l] @ W[l]^T) * scale_a * scale_b + bias, fp32 accumulate.
//
// A is [L, M, K] with K contiguous (row-major), W is [L, N, K] with K contiguous (the "column-major
// [K, N] b" of FlashInfer's API), D is [L, M, N] row-major. Both operands K-major is what wgmma
// needs for fp8 and what TMA loads best for 16-bit types.
//
// One tile configuration per translation unit (spec defines): FI_TA, FI_TB, FI_TD, FI_TBIAS,
// FI_TILE_M/N/K, FI_CLUSTER_M/N, FI_PINGPONG, FI_STREAMK, the scheduler's tile order FI_SWIZZLE /
// FI_RASTER (sm90_tile_order.cuh), and FI_PROMOTION for fp8 (wgmma K-steps between fp32
// promotions; 0 for 16-bit inputs, whose mainloop has no promotion). The Python side picks the unit per shape class.
//
// The epilogue is one visitor tree for every op: acc * (scale_a * scale_b) + bias[n]. Scales are
// device pointers (bmm_fp8's float32 tensors) or 1.0 when null; bias is a row broadcast that
// reads nothing when its pointer is null.
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/functional.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include "fi/common.cuh"
#include "../sm90_launch.cuh"
#include "../sm90_tile_order.cuh"

using namespace cute;

// A named namespace: a kernel template instantiated on anonymous-namespace types breaks nvcc's
// host stub. Symbols stay private anyway (-fvisibility=hidden).
namespace fi_sm90_impl {

using ElementA = FI_TA;
using ElementB = FI_TB;
using ElementD = FI_TD;
using ElementBias = FI_TBIAS;
using ElementAcc = float;

// 16-byte aligned rows: what TMA requires of every global stride but the unit one.
constexpr int kAlignA = 16 / sizeof(ElementA);
constexpr int kAlignB = 16 / sizeof(ElementB);
constexpr int kAlignD = 16 / sizeof(ElementD);

using TileShape = Shape<Int<FI_TILE_M>, Int<FI_TILE_N>, Int<FI_TILE_K>>;
using ClusterShape = Shape<Int<FI_CLUSTER_M>, Int<FI_CLUSTER_N>, _1>;

#if FI_PINGPONG
// Two consumer warpgroups on alternate tiles: one's epilogue overlaps the other's MMAs (mid M).
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
// Two consumer warpgroups split one large tile: the best MMA/load ratio for large M.
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif

namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

using Epilogue = fusion::Sm90EVT<
    fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float, kRound>,
    fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, int64_t>, 2>,   // scale_a * scale_b
    fusion::Sm90AccFetch,
    fusion::Sm90RowBroadcast<0, TileShape, ElementBias, float, Stride<_0, _1, int64_t>>>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float,
    void, cutlass::layout::RowMajor, kAlignD,
    ElementD, cutlass::layout::RowMajor, kAlignD,
    EpilogueSchedule, Epilogue>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, cutlass::layout::RowMajor, kAlignA,
    ElementB, cutlass::layout::ColumnMajor, kAlignB,
    ElementAcc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

#if FI_STREAMK
// Stream-K: when there are fewer output tiles than SMs (mid M: decode-adjacent batches against
// wide weights), CTAs also split K so every SM streams weights; partial tiles are reduced through
// the caller's workspace in a fixed (deterministic) order.
using TileScheduler = cutlass::gemm::StreamKScheduler;
#else
using TileScheduler = cutlass::gemm::PersistentScheduler;
#endif

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, TileScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

using StrideA = typename GemmKernel::StrideA;
using StrideB = typename GemmKernel::StrideB;
using StrideC = typename GemmKernel::StrideC;
using StrideD = typename GemmKernel::StrideD;

typename Gemm::Arguments make_args(void* d, const void* a, const void* b, const void* bias,
                                   const void* scale_a, const void* scale_b, int64_t m, int64_t n,
                                   int64_t k, int64_t l, int64_t lda, int64_t ldb, int64_t ldd,
                                   int64_t bsa, int64_t bsb, int64_t bsd) {
  StrideA sa = make_stride(lda, Int<1>{}, bsa);
  StrideB sb = make_stride(ldb, Int<1>{}, bsb);
  StrideD sd = make_stride(ldd, Int<1>{}, bsd);
  int dev = 0;
  cudaGetDevice(&dev);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = dev;
  hw.sm_count = fi::sm_count();
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {int(m), int(n), int(k), int(l)},
      {static_cast<const ElementA*>(a), sa, static_cast<const ElementB*>(b), sb},
      {{}, nullptr, StrideC{}, static_cast<ElementD*>(d), sd},
      hw};
  fi_gemm::set_tile_order(args);
#if FI_PROMOTION
  // fp8 wgmma accumulates in reduced precision; the mainloop adds its partial sums into the fp32
  // accumulators every FI_PROMOTION wgmma K-steps (CUTLASS's default is 4: once per 128-wide K tile).
  args.mainloop.mma_promotion_interval = FI_PROMOTION;
#endif
  auto& ev = args.epilogue.thread;
  auto& scales = ev.op_0;  // Sm90ScalarBroadcast::Arguments
  scales.scalars[0] = 1.0f;
  scales.scalars[1] = 1.0f;
  scales.scalar_ptrs[0] = static_cast<const float*>(scale_a);
  scales.scalar_ptrs[1] = static_cast<const float*>(scale_b);
  auto& row = ev.op_2;       // Sm90RowBroadcast::Arguments
  row.ptr_row = static_cast<const ElementBias*>(bias);
  row.null_default = ElementBias(0);
  return args;
}

}  // namespace fi_sm90_impl

using namespace fi_sm90_impl;

// Bytes of workspace the kernel needs for this problem (0 for the data-parallel persistent
// scheduler; stream-K partial tiles and flags otherwise).
FI_EXPORT int fi_gemm_sm90_workspace(void* out_bytes, int64_t m, int64_t n, int64_t k, int64_t l) {
  auto args = make_args(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k, l, k, k, n,
                        m * k, n * k, m * n);
  *static_cast<int64_t*>(out_bytes) = static_cast<int64_t>(Gemm::get_workspace_size(args));
  return 0;
}

// All host setup happens here; the workspace is the caller's buffer so nothing is allocated
// (CUDA-graph safe). Returns cudaErrorInvalidValue when the workspace is too small and
// cudaErrorNotSupported when CUTLASS rejects the problem (alignment the caller should have checked).
FI_EXPORT int fi_gemm_sm90(void* d, const void* a, const void* b, const void* bias,
                           const void* scale_a, const void* scale_b, int64_t m, int64_t n,
                           int64_t k, int64_t l, int64_t lda, int64_t ldb, int64_t ldd,
                           int64_t bsa, int64_t bsb, int64_t bsd, void* workspace,
                           int64_t workspace_bytes, cudaStream_t stream) {
  if (m == 0 || n == 0 || l == 0) return 0;
  const auto args = make_args(d, a, b, bias, scale_a, scale_b, m, n, k, l, lda, ldb, ldd, bsa, bsb, bsd);
  return fi_gemm::run_unit<Gemm>(args, workspace, workspace_bytes, stream);
}
