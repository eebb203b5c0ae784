// Philox4x32-10 counter-based RNG (Salmon et al., SC'11). A counter-based generator lets every
// (seed, offset, row, round) tuple map to its own random numbers without any state in memory, so
// the same seed/offset reproduce the same tokens in eager mode and under CUDA-graph replay.
#pragma once

#include "fi/common.cuh"

namespace fi::sampling {

struct Philox {
  static constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;   // round multipliers
  static constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;   // Weyl key increments

  FI_DEVICE static uint4 round(uint4 c, uint2 k) {
    const uint32_t lo0 = kM0 * c.x, hi0 = __umulhi(kM0, c.x);
    const uint32_t lo1 = kM1 * c.z, hi1 = __umulhi(kM1, c.z);
    return make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }

  // Ten rounds with the key bumped between rounds: the full-strength (Crush-resistant) variant.
  FI_DEVICE static uint4 generate(uint4 ctr, uint2 key) {
#pragma unroll
    for (int i = 0; i < 9; ++i) {
      ctr = round(ctr, key);
      key.x += kW0;
      key.y += kW1;
    }
    return round(ctr, key);
  }
};

// One uniform float in [0, 1) for (seed, offset, row, draw): 24 random bits, so 1.0 is impossible.
FI_DEVICE float philox_uniform(uint64_t seed, uint64_t offset, uint32_t row, uint32_t draw) {
  const uint4 ctr = make_uint4((uint32_t)offset, (uint32_t)(offset >> 32), row, draw);
  const uint2 key = make_uint2((uint32_t)seed, (uint32_t)(seed >> 32));
  return (float)(Philox::generate(ctr, key).x >> 8) * (1.0f / 16777216.0f);
}

}  // namespace fi::sampling
