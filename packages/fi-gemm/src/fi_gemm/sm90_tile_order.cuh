// Tile order of a CUTLASS sm90 persistent-scheduler unit, from its build defines:
//   FI_SWIZZLE  max swizzle size, 1, 2, 4 or 8: the scheduler walks the tile grid in bands of that
//               many tiles along the minor dimension, so the CTAs of one wave share A and W rows in
//               L2 instead of sweeping all of W every wave;
//   FI_RASTER   0 CUTLASS's heuristic, 1 along M, 2 along N.
// Included by the dense (gemm_sm90.cu) and block-scaled (gemm_blockwise_sm90.cu) units after their
// CUTLASS headers.
#pragma once

namespace fi_gemm {

using RasterOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;
constexpr RasterOptions kRaster = FI_RASTER == 1   ? RasterOptions::AlongM
                                  : FI_RASTER == 2 ? RasterOptions::AlongN
                                                   : RasterOptions::Heuristic;
static_assert(FI_SWIZZLE == 1 || FI_SWIZZLE == 2 || FI_SWIZZLE == 4 || FI_SWIZZLE == 8,
              "FI_SWIZZLE is the scheduler's max swizzle size: 1, 2, 4 or 8");

// Sets the unit's tile order on a GemmUniversal argument struct.
template <typename Arguments>
inline void set_tile_order(Arguments& args) {
  args.scheduler.max_swizzle_size = FI_SWIZZLE;
  args.scheduler.raster_order = kRaster;
}

}  // namespace fi_gemm
