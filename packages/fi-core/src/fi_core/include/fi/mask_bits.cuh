// Packed boolean attention masks (FlashInfer's packbits, little bit order: bit i of byte b is
// element 8 b + i), read by the attention kernels as 32-key windows of one query row.
#pragma once

#include <cstdint>

#include "fi/common.cuh"

namespace fi {

// 32 mask bits of one query row whose first bit is `row_bit` (row index x kv_len, in bits from
// `mask`): bit c is key col0 + c, for the keys below kv_len; bits past kv_len read as 0. Reads the
// at most 5 bytes that hold the window, never a byte past the row's last key (so never past the
// mask), instead of one load per element. (A form with the row's byte pointer hoisted and 32-bit
// funnel shifts allocated worse in the fa3 consumers: 48 / 40 bytes of spill against 32 / 32.)
FI_DEVICE uint32_t mask_window32(const uint8_t* mask, int64_t row_bit, int col0, int kv_len) {
  const int n = min(32, kv_len - col0);
  if (n <= 0) return 0u;
  const int64_t sb = row_bit + col0;
  const uint8_t* b = mask + (sb >> 3);
  const int sh = int(sb & 7);
  const int nbytes = ((sh + n - 1) >> 3) + 1;
  uint64_t acc = 0;
#pragma unroll
  for (int j = 0; j < 5; ++j) {
    if (j < nbytes) acc |= uint64_t(__ldg(b + j)) << (8 * j);
  }
  return uint32_t(acc >> sh);
}

// Bits lo <= j < hi of a 32-bit word (any ints; empty when hi <= lo): a row's visible key range
// folded into its mask window, so each logit costs one bit test.
FI_DEVICE uint32_t range_bits32(int lo, int hi) {
  lo = max(lo, 0);
  hi = min(hi, 32);
  if (hi <= lo) return 0u;
  const uint32_t below_hi = hi == 32 ? 0xffffffffu : (1u << hi) - 1u;
  return below_hi & ~((1u << lo) - 1u);  // lo < hi <= 32, so lo < 32
}

}  // namespace fi
