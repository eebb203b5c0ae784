// Ampere / Ada GEMM through CUTLASS 2.x: D[l] = (A[l] @ W[l]^T) * scale_a * scale_b + bias[n],
// fp32 accumulate, for M > 16 where Hopper's TMA / wgmma unit (gemm_sm90.cu) is not available.
//
// Layouts as in gemm_sm90.cu: A [L, M, K] and W [L, N, K] K-contiguous (W^T is the column-major
// [K, N] operand), D [L, M, N] row-major. The mainloop is CUTLASS's multistage one: cp.async
// fills FI_STAGES shared-memory stages while the warps run mma.sync on the oldest
// (m16n8k16 for 16-bit inputs on sm_80+, m16n8k32 for fp8 on sm_89+).
//
// One unit per translation unit (spec defines): FI_TA, FI_TB (equal widths), FI_TD, the
// threadblock tile FI_TILE_M/N/K, the warp tile FI_WARP_M/N (warp K = FI_TILE_K) and FI_STAGES.
//
// The epilogue computes acc * (scale_a * scale_b) (+ bias[n]) in fp32 and rounds once. Scales are
// device pointers read by each thread when its epilogue starts (null: 1.0). The bias is the
// epilogue's source operand read with a row stride of 0, so every row sees the same N values; it
// must therefore have the output's dtype (the Python side checks that and otherwise takes
// another backend).
#include <cutlass/cutlass.h>
#include <cutlass/array.h>
#include <cutlass/numeric_types.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/epilogue/thread/scale_type.h>
#include <cutlass/gemm/device/gemm_universal.h>

#include "fi/common.cuh"

namespace fi_sm80_impl {

using ElementA = FI_TA;
using ElementB = FI_TB;
using ElementD = FI_TD;
static_assert(sizeof(ElementA) == sizeof(ElementB), "A and W must have the same width");
constexpr bool kFp8 = sizeof(ElementA) == 1;

// 16-byte aligned rows, the width of one cp.async.
constexpr int kAlignA = 16 / sizeof(ElementA);
constexpr int kAlignB = 16 / sizeof(ElementB);
constexpr int kAlignD = 16 / sizeof(ElementD);

// Epilogue functor in the form CUTLASS 2.x's threadblock epilogue calls: a fragment of N
// accumulators (and, when is_source_needed(), N source values) in, N outputs out.
template <typename Out, int N>
struct ScaleBias {
  using ElementOutput = Out;
  using ElementSource = Out;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = Out;
  using ElementD = Out;
  static int const kCount = N;
  static const cutlass::epilogue::thread::ScaleType::Kind kScale =
      cutlass::epilogue::thread::ScaleType::Default;
  static cutlass::FloatRoundStyle const kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using FragmentOutput = cutlass::Array<Out, N>;
  using FragmentSource = cutlass::Array<Out, N>;
  using FragmentAccumulator = cutlass::Array<float, N>;
  using FragmentCompute = cutlass::Array<float, N>;

  struct Params {
    float const* scale_a = nullptr;
    float const* scale_b = nullptr;
    bool bias = false;
  };

  float alpha;
  bool bias;

  // Runs on the device only (inside the kernel), like CUTLASS's pointer-mode alpha.
  CUTLASS_HOST_DEVICE explicit ScaleBias(Params const& p)
      : alpha((p.scale_a ? *p.scale_a : 1.f) * (p.scale_b ? *p.scale_b : 1.f)), bias(p.bias) {}

  CUTLASS_HOST_DEVICE bool is_source_needed() const { return bias; }
  CUTLASS_HOST_DEVICE void set_k_partition(int, int) {}  // no serial split-K here

  CUTLASS_HOST_DEVICE FragmentOutput operator()(FragmentAccumulator const& acc,
                                                FragmentSource const& src) const {
    cutlass::NumericArrayConverter<float, Out, N, kRound> widen;
    cutlass::NumericArrayConverter<Out, float, N, kRound> narrow;
    const FragmentCompute s = widen(src);
    FragmentCompute r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) r[i] = acc[i] * alpha + s[i];
    return narrow(r);
  }

  CUTLASS_HOST_DEVICE FragmentOutput operator()(FragmentAccumulator const& acc) const {
    cutlass::NumericArrayConverter<Out, float, N, kRound> narrow;
    FragmentCompute r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) r[i] = acc[i] * alpha;
    return narrow(r);
  }
};

using Epilogue = ScaleBias<ElementD, kAlignD>;
using ArchTag = std::conditional_t<kFp8, cutlass::arch::Sm89, cutlass::arch::Sm80>;
using InstShape = std::conditional_t<kFp8, cutlass::gemm::GemmShape<16, 8, 32>,
                                     cutlass::gemm::GemmShape<16, 8, 16>>;

using Gemm = cutlass::gemm::device::GemmUniversal<
    ElementA, cutlass::layout::RowMajor, ElementB, cutlass::layout::ColumnMajor, ElementD,
    cutlass::layout::RowMajor, float, cutlass::arch::OpClassTensorOp, ArchTag,
    cutlass::gemm::GemmShape<FI_TILE_M, FI_TILE_N, FI_TILE_K>,
    cutlass::gemm::GemmShape<FI_WARP_M, FI_WARP_N, FI_TILE_K>, InstShape, Epilogue,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, FI_STAGES, kAlignA, kAlignB,
    cutlass::arch::OpMultiplyAdd>;

}  // namespace fi_sm80_impl

using fi_sm80_impl::Gemm;

// All host setup happens here; nothing is allocated (a GEMM without split-K needs no workspace),
// so the call is CUDA-graph safe. Returns cudaErrorNotSupported when CUTLASS rejects the problem
// (alignment the caller should have checked) and the launch error otherwise.
FI_EXPORT int fi_gemm_sm80(void* d, const void* a, const void* b, const void* bias,
                           const void* scale_a, const void* scale_b, int64_t m, int64_t n,
                           int64_t k, int64_t l, int64_t lda, int64_t ldb, int64_t ldd,
                           int64_t bsa, int64_t bsb, int64_t bsd, cudaStream_t stream) {
  if (m == 0 || n == 0 || l == 0) return 0;
  if (m >= (int64_t(1) << 31) || n >= (int64_t(1) << 31) || k >= (int64_t(1) << 31) ||
      l >= (int64_t(1) << 31))
    return (int)cudaErrorInvalidValue;
  typename Gemm::EpilogueOutputOp::Params ep;
  ep.scale_a = static_cast<const float*>(scale_a);
  ep.scale_b = static_cast<const float*>(scale_b);
  ep.bias = bias != nullptr;
  const auto mode = l > 1 ? cutlass::gemm::GemmUniversalMode::kBatched
                          : cutlass::gemm::GemmUniversalMode::kGemm;
  // The bias is the source C with row stride 0 and batch stride 0.
  typename Gemm::Arguments args(mode, cutlass::gemm::GemmCoord(int(m), int(n), int(k)), int(l), ep,
                                a, b, bias, d, bsa, bsb, 0, bsd, lda, ldb, 0, ldd);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return (int)cudaErrorNotSupported;
  if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess)
    return (int)cudaErrorNotSupported;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return (int)(err != cudaSuccess ? err : cudaErrorLaunchFailure);
  }
  return 0;
}
