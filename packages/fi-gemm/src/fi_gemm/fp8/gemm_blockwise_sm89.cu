// Block-scaled FP8 GEMM on mma.sync (sm_89+), the M > 16 path of gemm_fp8_nt_groupwise where
// the Hopper TMA unit (gemm_blockwise_sm90.cu) is not available, i.e. on Ada (on Hopper it runs
// only when asked for by name, which is how the H200 tests it).
//
//   out[m, n] = sum_kb (A[m, kb-block] . W[n, kb-block]) * sa[m, kb] * sb[n / 128, kb]
//
// A [M, K] and W [N, K] are K-contiguous fp8 (e4m3 / e5m2); sa is indexed [row, kb] through the
// strides (sam, sak) and sb [nb, kb] through (sbn, sbk), so "K"- and "MN"-major scales run the
// same code. K % 16 == 0 (16-byte rows); a last partial 128-wide block is zero-filled.
//
// Tiling: a CTA computes a 128 x 128 output tile; one K step is one 128-wide scale block. Eight
// warps as 2 (M) x 4 (N), each 64 x 32, i.e. 4 x 4 m16n8k32 accumulator tiles. Every K step
// accumulates a fresh partial tile, which is then scaled by sa[row] * sb (one weight scale per
// CTA: the N tile is one 128-row scale block) and added to the fp32 totals.
// A and W tiles reach shared memory through 3 stages of cp.async (16 KB each per stage, 96 KB in
// all, within the 99 KB an sm_89 block may take). Rows are 128 bytes; the 16-byte chunk c of row r
// sits at chunk c ^ 4 * (r & 1), so the 8 lanes of each quarter-warp read 8 different bank groups.
//
// Fragments: as in dense/gemv.cu, a dot product does not care about the order of k, so each lane
// reads one 16-byte chunk per row (rows g and g + 8 of A, row g of W; g = lane / 4, chunk
// 4 * half + lane % 4) and feeds its four words to two MMAs: words {0, 1} to the first, {2, 3} to
// the second. A's and W's fragments then hold the same physical k at matching logical slots.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fi/common.cuh"
#include "fi/mma.cuh"
#include "fi/pipeline.cuh"

namespace {

constexpr int kBM = 128, kBN = 128, kBK = 128, kStages = 3, kThreads = 256;
constexpr int kTile = kBM * kBK;  // bytes of one operand's tile per stage (kBN == kBM)
constexpr int kSmem = kStages * 2 * kTile;
static_assert(kBN == 128, "one weight scale block per CTA tile");


template <typename T> FI_DEVICE T from_f32(float x);
template <> FI_DEVICE __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> FI_DEVICE __half from_f32<__half>(float x) { return __float2half_rn(x); }

struct Params {
  void* out;
  const uint8_t* a;
  const uint8_t* w;
  const float* sa;
  const float* sb;
  int m, n, k;
  int64_t lda, ldw, ldo, sam, sak, sbn, sbk;
};

// Byte offset of 16-byte chunk c of tile row r.
FI_DEVICE uint32_t swz(int r, int c) { return uint32_t(r * 128 + ((c ^ ((r & 1) << 2)) << 4)); }

template <typename TA, typename TW, typename TD>
__global__ void __launch_bounds__(kThreads, 1) blockwise_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp >> 2, wn = warp & 3;  // 2 x 4 warps of 64 x 32
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const int nk = (p.k + kBK - 1) / kBK;
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  // 1024 chunks per operand tile, four per thread; rows or K columns outside the problem are
  // zero-filled (nothing is read for them).
  auto load_stage = [&](int kb, int slot) {
    const uint32_t s_a = sbase + uint32_t(slot) * (2 * kTile);
    const uint32_t s_w = s_a + kTile;
    const int k0 = kb * kBK;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + i * kThreads;
      const int r = idx >> 3, c = idx & 7;
      const int kc = k0 + c * 16;
      const bool ka = kc < p.k && m0 + r < p.m;
      const bool kw = kc < p.k && n0 + r < p.n;
      fi::cp_async_16(s_a + swz(r, c), p.a + (ka ? int64_t(m0 + r) * p.lda + kc : 0), ka);
      fi::cp_async_16(s_w + swz(r, c), p.w + (kw ? int64_t(n0 + r) * p.ldw + kc : 0), kw);
    }
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s, s);
    fi::cp_async_commit();
  }
  for (int kb = 0; kb < nk; ++kb) {
    fi::cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kb landed for every thread; stage kb - 1 is no longer read
    const int next = kb + kStages - 1;
    if (next < nk) load_stage(next, next % kStages);
    fi::cp_async_commit();

    // This block's scales, loaded before the MMAs so their latency hides behind them.
    const float sbv = p.sb[int64_t(blockIdx.x) * p.sbn + int64_t(kb) * p.sbk];
    float sav[4][2];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm * 64 + i * 16 + h * 8 + g;
        sav[i][h] = row < p.m ? p.sa[int64_t(row) * p.sam + int64_t(kb) * p.sak] : 0.f;
      }

    const uint8_t* s_a = smem + (kb % kStages) * (2 * kTile);
    const uint8_t* s_w = s_a + kTile;
    float part[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[i][j][e] = 0.f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int c = half * 4 + t;
      uint4 wf[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wf[j] = *reinterpret_cast<const uint4*>(s_w + swz(wn * 32 + j * 8 + g, c));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = wm * 64 + i * 16 + g;
        const uint4 a0 = *reinterpret_cast<const uint4*>(s_a + swz(r, c));
        const uint4 a1 = *reinterpret_cast<const uint4*>(s_a + swz(r + 8, c));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          fi::Mma16832Fp8<TA, TW>::run(part[i][j], a0.x, a1.x, a0.y, a1.y, wf[j].x, wf[j].y);
          fi::Mma16832Fp8<TA, TW>::run(part[i][j], a0.z, a1.z, a0.w, a1.w, wf[j].z, wf[j].w);
        }
      }
    }
    // Accumulator element e of tile (i, j): row g + 8 * (e / 2), column 2 * t + e % 2.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float s0 = sav[i][0] * sbv, s1 = sav[i][1] * sbv;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[i][j][0] += part[i][j][0] * s0;
        acc[i][j][1] += part[i][j][1] * s0;
        acc[i][j][2] += part[i][j][2] * s1;
        acc[i][j][3] += part[i][j][3] * s1;
      }
    }
  }
  fi::cp_async_wait<0>();

  TD* out = static_cast<TD*>(p.out);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + wm * 64 + i * 16 + h * 8 + g;
      if (row >= p.m) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = n0 + wn * 32 + j * 8 + 2 * t;
        TD* o = out + int64_t(row) * p.ldo + col;
        if (col < p.n) o[0] = from_f32<TD>(acc[i][j][2 * h]);
        if (col + 1 < p.n) o[1] = from_f32<TD>(acc[i][j][2 * h + 1]);
      }
    }
}

}  // namespace

// K a multiple of 16, rows of A and W 16-byte aligned (checked in Python, re-checked here as a
// cheap guard against out-of-bounds vector loads). No allocation: CUDA-graph safe.
FI_EXPORT int fi_gemm_blockwise_sm89(void* out, const void* a, const void* w, const void* sa,
                                     const void* sb, int64_t m, int64_t n, int64_t k, int64_t lda,
                                     int64_t ldw, int64_t ldo, int64_t sam, int64_t sak,
                                     int64_t sbn, int64_t sbk, cudaStream_t stream) {
  if (k % 16 != 0 || lda % 16 != 0 || ldw % 16 != 0 ||
      ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(w)) & 15) != 0 ||
      sa == nullptr || sb == nullptr || m >= (int64_t(1) << 31) || n >= (int64_t(1) << 31) ||
      k >= (int64_t(1) << 31))
    return (int)cudaErrorInvalidValue;
  if (m == 0 || n == 0) return 0;
  const int64_t gy = (m + kBM - 1) / kBM, gx = (n + kBN - 1) / kBN;
  if (gy > 65535) return (int)cudaErrorInvalidConfiguration;
  auto* kernel = blockwise_kernel<FI_TA, FI_TW, FI_TD>;
  // The 96 KB opt-in is a per-device function attribute: set once per device.
  static bool opted[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return (int)cudaErrorInvalidDevice;
  if (!opted[dev]) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return (int)e;
    opted[dev] = true;
  }
  Params p{};
  p.out = out;
  p.a = static_cast<const uint8_t*>(a);
  p.w = static_cast<const uint8_t*>(w);
  p.sa = static_cast<const float*>(sa);
  p.sb = static_cast<const float*>(sb);
  p.m = int(m); p.n = int(n); p.k = int(k);
  p.lda = lda; p.ldw = ldw; p.ldo = ldo; p.sam = sam; p.sak = sak; p.sbn = sbn; p.sbk = sbk;
  kernel<<<dim3(unsigned(gx), unsigned(gy)), kThreads, kSmem, stream>>>(p);
  return (int)cudaGetLastError();
}
