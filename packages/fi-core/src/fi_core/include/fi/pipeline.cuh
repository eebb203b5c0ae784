// Asynchronous global -> shared copies (cp.async, sm_80+) used by multi-stage pipelines.
// Pattern: issue copies for stage s, commit_group(); later wait_group<N>() leaves at most N
// groups in flight, then __syncthreads() makes the landed data visible to every warp.
#pragma once

#include "fi/common.cuh"

namespace fi {

// 16-byte copy bypassing L1 (.cg). When `valid` is false nothing is read from global memory and
// the 16 destination bytes are zero-filled (src-size 0), so out-of-range rows are zeros, not
// garbage (a masked probability of 0 times garbage NaN would still be NaN).
FI_DEVICE void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_size));
}

// Unpredicated 16-byte copy for rings that a warp refills in place: the "memory" clobber keeps the
// compiler from moving it above the shared-memory reads (and the __syncwarp) that must precede the
// overwrite of a stage.
FI_DEVICE void cp_async_16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem) : "memory");
}

FI_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
FI_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace fi
