// Packed boolean attention masks (FlashInfer's packbits, little bit order: bit i of byte b is
// element 8 b + i), read by the attention kernels as 32-key windows of one query row.
#pragma once

#include <cstdint>

#include "fi/common.cuh"

namespace fi {

// 32 mask bits of one query row whose first bit is `row_bit` (row index x kv_len, in bits from
// `mask`): bit c is key col0 + c, for the keys below kv_len; bits past kv_len read as 0. Reads the
// at most 5 bytes that hold the window, never a byte past the row's last key (so never past the
// mask), instead of one load per element. The kernels read rows through mask_windows32 below,
// which falls back to this form only for rows at the very start or end of a request's mask.
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

// kW consecutive windows of one row: window w is mask_window32(mask, row_bit, col0 + 32 w, kv_len)
// except that bits past kv_len are not cleared (they hold the next row's bits; callers fold the
// row's key range in anyway). The kW * 32 bits are read as kW + 1 aligned 32-bit words and
// funnel-shifted into place: kW + 1 loads and kW shifts, where the byte form takes up to 5 kW
// dependent byte loads and their shifts. Aligned words may begin up to 3 bytes before the window's
// first byte and end past its last, so they are read only where they lie in [mask, end) (the
// request's mask bytes, which the caller knows to be readable); a row at the very start or end of
// the request takes the byte form.
template <int kW>
FI_DEVICE void mask_windows32(const uint8_t* mask, const uint8_t* end, int64_t row_bit, int col0, int kv_len,
                              uint32_t (&out)[kW]) {
  const int64_t sb = row_bit + col0;
  const uintptr_t first = reinterpret_cast<uintptr_t>(mask + (sb >> 3));
  const uintptr_t w0 = first & ~uintptr_t(3);
  if (w0 >= reinterpret_cast<uintptr_t>(mask) && w0 + 4 * (kW + 1) <= reinterpret_cast<uintptr_t>(end)) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(w0);
    const int sh = int(first & 3) * 8 + int(sb & 7);  // little bit order: bit j of a word is key 32 k + j
    uint32_t word[kW + 1];
#pragma unroll
    for (int k = 0; k <= kW; ++k) word[k] = __ldg(w + k);
#pragma unroll
    for (int k = 0; k < kW; ++k) out[k] = __funnelshift_r(word[k], word[k + 1], sh);
  } else {
#pragma unroll
    for (int k = 0; k < kW; ++k) out[k] = mask_window32(mask, row_bit, col0 + 32 * k, kv_len);
  }
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
