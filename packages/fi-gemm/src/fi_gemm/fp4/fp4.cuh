// What quant.cu, dequant.cu and gemv_fp4.cu share about FP4 block-scaled data: where scale (row r, column
// c) sits in each layout (the formulas of fi_gemm/fp4/reference.py) and what a scale byte means.
#pragma once

#include <cuda_fp8.h>

#include "fi/common.cuh"

namespace fi_fp4 {

// 128x4: 512-byte tiles of 128 rows x 4 columns, row-major over [rows / 128, k_tiles].
FI_DEVICE int64_t sf_offset_128x4(int64_t r, int c, int k_tiles) {
  return ((r >> 7) * k_tiles + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3);
}

// 8x4: 32-byte tiles of 8 rows x 4 columns. In both swizzled layouts columns c and c + 1 (c even)
// are adjacent bytes.
FI_DEVICE int64_t sf_offset_8x4(int64_t r, int c, int k_tiles) {
  return ((r >> 3) * k_tiles + (c >> 2)) * 32 + (r & 7) * 4 + (c & 3);
}

// The layout codes of fi_gemm/fp4/reference.py's LAYOUT_CODE.
enum SfLayout : int { kSf128x4 = 0, kSf8x4 = 1, kSfLinear = 2 };

// Byte offset of scale (r, c) in `layout`: k_tiles = ceil(cols / 4) for the swizzled layouts,
// cols (= k / block) the linear row length.
FI_DEVICE int64_t sf_offset(int layout, int64_t r, int c, int k_tiles, int cols) {
  if (layout == kSf128x4) return sf_offset_128x4(r, c, k_tiles);
  if (layout == kSf8x4) return sf_offset_8x4(r, c, k_tiles);
  return r * cols + c;
}

// An NVFP4 scale byte (float8_e4m3fn) as a float.
FI_DEVICE float e4m3_to_float(uint32_t byte) {
  __nv_fp8_e4m3 s;
  s.__x = static_cast<__nv_fp8_storage_t>(byte);
  return static_cast<float>(s);
}

}  // namespace fi_fp4
