// Weight-streaming GEMM for decode shapes (M <= 16): out[l, m, n] = sum_k A[l, m, k] W[l, n, k]
// (* scale_a * scale_b + bias[n]). At M <= 16 the GEMM is a pass over W, so the kernel is built
// to keep HBM busy: every thread issues several 16-byte W loads before it consumes any, and the
// tensor cores do the math so the ALUs never become the limit.
//
// Tensor-core mapping (mma.sync m16n8kX, X = 16 for 16-bit, 32 for fp8): the MMA's "A" operand
// is a 16-row slab of W, its "B" operand is 8 activation rows (tokens), the accumulator is
// [16 W rows x 8 tokens]. A dot product does not care about the order of k, so each thread loads
// one contiguous 16-byte vector per row (W rows g and g+8, token g; g = lane / 4, t = lane % 4,
// vector at k = step * 4V + t * V, V elements per 16 bytes) and feeds its 4 words to two MMAs:
// words {0,1} to the first, {2,3} to the second. The fragment layouts of A and B then assign the
// same physical k to matching logical columns/rows, so the product is exact for any permutation.
//
// Work split: a CTA owns RS slabs of 16 W rows; its WARPS warps split K (interleaved steps, so the
// CTA reads long contiguous runs of each row) and are reduced through shared memory at the end.
// No global split-K: N >= 2048 already gives >= 128 CTAs for decode layers.
//
// Loads stay in registers. Measured and not kept (H200, gemv_ring A/B in
// benchmarks/results/h200): each thread keeping 8 / 4 steps of its loads in flight in a private
// shared-memory ring (16-byte cp.async, refilled as consumed) was slower at N = K = 4096: M = 1 /
// 4 / 16 took 11.76 / 12.61 / 13.95 us against 10.57 / 10.80 / 11.86, the 8 x 512-row LoRA
// segment GEMM 16.43 against 13.27 (only its 8 x 16-row case gained: 5.83 against 6.86).
// Also measured and not kept (same shapes, register kernel timed in the same run; *_ab_gemv_bulk1d*,
// *_ab_gemv_tma*, segment_gemm_ab_seg_u* in benchmarks/results/h200): a warp-specialised variant in
// which one producer thread fills a ring of shared-memory stages through the copy engine and four
// warps run the same MMAs from shared memory. With one 1-D bulk copy per row and 512-byte stage
// M = 1 / 4 / 16 took 13.8 / 15.3 / 18.0 us against 10.5 / 10.9 / 12.1 (256-byte stages: 23.9 /
// 27.0 / 31.6, so each copy instruction costs the SM ~36 cycles of copy-engine time); with 2-D TMA
// boxes (16 or 32 rows x 512 bytes per instruction) 12.8 / 11.8 / 12.3 against 10.6 / 11.0 / 12.0,
// and 11.7 / 11.6 at M = 1 / 4 with 8 stages in flight: more bytes in flight per SM than the
// register kernel, and still slower. bmm_fp8 M = 16: 8.5 against 7.7; the LoRA segment GEMM
// 13.2 against 13.0. Raising the segment pair unit's steps in flight from 2 to 3 / 4: 14.2 / 14.5
// against 13.1 (8 x 512 rows).
// Session 8 (tools/ab_gemv.py, builds timed in turns in one process; gemv_ab_*_session8.json):
// - rolling refill (each register slot reloaded with the step U * kWarps ahead as soon as its MMAs
//   were issued, so U steps stay in flight without a gap between rounds): M = 1 / 4 / 16 11.18 /
//   11.31 / 11.84 us against 10.71 / 11.05 / 11.75, bmm_fp8 M = 16 9.55 against 8.00 (spills);
// - the M = 9..16 units with their activation rows staged once in shared memory by bulk copies
//   (fewer registers: 79 instead of 114, so U could rise to 6-8): M = 16 14.07 against 11.74,
//   bmm_fp8 M = 16 9.43 against 8.01; every CTA waits for its 64 KB before its first MMA, and
//   more steps in flight made it slower still. With the rolling refill, the M = 16 pair with 3
//   steps in flight: 12.03 against 11.84 with 2.
// - one CTA per SM (up to 255 registers) with twice the rows, so the re-read operand crosses from
//   L2 half as often: the M = 16 pair over 64 W rows 14.4-15.4 us against 11.23, LoRA 8 x 512 with
//   64-row tiles 13.1-15.6 against 12.71 (2-4 steps in flight): 8 warps per SM hide too little.
// - more warps instead: K split over clusters of 3 CTAs at 3 per SM (80 registers) or 4 at 4 per
//   SM (64): M = 16 17.9-18.3 us against 11.35, LoRA 8 x 512 20.1-23.2 against 12.61. The pair at
//   2 CTAs per SM stays.
// - a probe without the segment lookup (tiles mapped to rows directly, valid only for equal
//   segments of a multiple of 32 rows): LoRA 8 x 512 12.92 us against 12.70 with the lookup, so the
//   lookup's dependent round trip is not what keeps that case behind torch.bmm (11.79).
// - the CUTLASS sm90 GEMM with A and B swapped (W as the 128-row M side, 16 tokens as N, stream-K
//   over K): 17.1-17.9 us for M = 16 with 128x16x128 / 128x16x256 / 128x32x128 tiles, against
//   11.31 for this kernel (probe_swapab_cutlass_session8.txt).
// Session 9: each CTA asking L2 for all its streamed bytes at the start (cp.async.bulk.prefetch.L2,
// one per streamed row or per 4 KB), so HBM would not wait on the registers in flight: M = 1 / 16
// 13.13 / 14.90 us against 10.25 / 11.13, LoRA 8 x 512 15.95 against 12.03, bmm_fp8 M = 16 8.36
// against 7.25 (gemv_ab_bulkpf_session9.json); only the 16-row LoRA segments gained (6.41 / 6.61).
// Session 12, the LoRA shrink (8 x 512 rows, 4096 -> 16; tools/ab_gemv.py in turns):
// - the pair's W share (16 rows x 2048) staged in shared memory by cp.async at the start and read
//   from there at each MMA, so only x stays in registers and 2 / 3 / 4 steps of it are in flight:
//   13.53 / 14.05 / 13.52 us against 11.47 (8 x 16 rows: 8.74 / 8.53 / 7.14 against 6.29): every
//   CTA waits for its 64 KB of W before the first MMA (gemv_ab_wsm_session12.json);
// - 2 / 4 K steps of x prefetched before the PDL wait instead of 1: 11.77 / 12.68 against 11.54;
//   all of W prefetched before the wait as well: 11.50, x1.004, i.e. noise
//   (gemv_ab_segpf_session12.json).
// - every round asking L2 (prefetch.global.L2) for the next round's streamed vectors while its own
//   loads are in flight: x0.76-0.83 on every shape (LoRA 8 x 512 14.85 against 11.49 us, M = 1 / 16
//   11.82 / 13.81 against 9.27 / 10.48, bmm_fp8 M = 16 8.25 against 6.88;
//   gemv_ab_rpf_session12.json);
// - 64-row tiles split over K by a 4-CTA cluster (half the W bytes per row of x, 16 warps per SM
//   kept, 104 / 128 registers at 1 / 2 steps in flight): 18.95 / 19.44 us against 11.50
//   (gemv_ab_seg_quad_session12.json).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fi/common.cuh"
#include "fi/mma.cuh"
#include "fi/vec.cuh"

// Thread-block clusters are available (FI_TARGET_CC: the build's GPU, from fi-core's compile
// command, visible to host and device code alike).
#ifndef FI_TARGET_CC
#error "gemv.cu is built through fi-core's compile command, which defines FI_TARGET_CC"
#endif
#define FI_GEMV_SM90 (FI_TARGET_CC >= 90)
#if FI_GEMV_SM90
#include <cooperative_groups.h>
#endif

namespace {

template <typename T> FI_DEVICE float to_f32(T x) { return float(x); }
template <> FI_DEVICE float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> FI_DEVICE float to_f32<__half>(__half x) { return __half2float(x); }

template <typename T> FI_DEVICE T from_f32(float x);
template <> FI_DEVICE __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> FI_DEVICE __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> FI_DEVICE float from_f32<float>(float x) { return x; }

// c += A(16 x K) * B(K x 8) for one MMA; a0..a3/b0..b1 in the PTX fragment order.
template <typename TW, typename TA> struct Mma;

template <> struct Mma<__nv_bfloat16, __nv_bfloat16> {
  static FI_DEVICE void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                            uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <> struct Mma<__half, __half> {
  static FI_DEVICE void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                            uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// fp8 MMAs (m16n8k32, sm_89+: fi/mma.cuh) are only instantiated by fp8 modules, which the Python
// side builds for sm_89+ only. W is the A operand.
template <> struct Mma<__nv_fp8_e4m3, __nv_fp8_e4m3> : fi::Mma16832Fp8<__nv_fp8_e4m3, __nv_fp8_e4m3> {};
template <> struct Mma<__nv_fp8_e4m3, __nv_fp8_e5m2> : fi::Mma16832Fp8<__nv_fp8_e4m3, __nv_fp8_e5m2> {};
template <> struct Mma<__nv_fp8_e5m2, __nv_fp8_e4m3> : fi::Mma16832Fp8<__nv_fp8_e5m2, __nv_fp8_e4m3> {};
template <> struct Mma<__nv_fp8_e5m2, __nv_fp8_e5m2> : fi::Mma16832Fp8<__nv_fp8_e5m2, __nv_fp8_e5m2> {};

// W is read exactly once: bypass L1 and ask L2 to fetch 128 B around each miss (the CTA's warps
// consume the neighbouring bytes of the row in the same pass).
// FI_GEMV_PF: bytes L2 fetches around each miss (128, or 256 / 0 for A/B runs). 128 measured
// faster than 256 at M = 4 and 16 and on the fp8 and LoRA 512-row shapes (tools/ab_gemv.py,
// gemv_ab_hints_session8.json: M = 16 11.37 -> 11.17 us, bmm_fp8 M = 16 7.51 -> 7.31, LoRA 8 x 512
// 12.68 -> 12.11), equal at M = 1 and on 16-row LoRA segments; no prefetch was slower (M = 1 11.08). Also measured there and not kept: the re-read activations
// past L1 like W (M = 16 13.04, bmm_fp8 M = 16 9.87), and the M = 16 pair with 3 steps in flight
// (12.59).
#ifndef FI_GEMV_PF
#define FI_GEMV_PF 128
#endif
FI_DEVICE uint4 load_stream(const void* p) {
#if FI_GEMV_PF == 128
  return fi::load16_stream(p);
#else
  uint4 v;
#if FI_GEMV_PF == 256
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
#else
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
#endif
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#endif
}

// Activations are re-read by every CTA: keep them in the caches.
FI_DEVICE uint4 load_cached(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

constexpr int kWarps = 8;

// FI_GEMV_PDL (sm_90): launch with programmatic stream serialization, so the grid is set up while
// its predecessor in the stream finishes; the kernel waits (griddepcontrol.wait) before its first
// global access and lets its own successor launch once its loads are issued.
#ifndef FI_GEMV_PDL
#define FI_GEMV_PDL FI_GEMV_SM90
#endif
// FI_GEMV_PREWAIT: with PDL, prefetch each thread's first W vectors into L2 before the wait
// (0 for A/B runs: no prefetch).
#ifndef FI_GEMV_PREWAIT
#define FI_GEMV_PREWAIT 1
#endif

// FI_GEMV_SEGWC: the segment unit (XS) reads its W vectors, which 16 CTAs of a segment share
// through L2, with the cached load (L1-allocating, no L2 fetch-around) instead of the streaming
// one. H200, LoRA 8 x 512 rows, 4096 -> 16, tools/ab_gemv.py in turns against 0, three calls:
// 11.26 / 11.32 / 11.30 us against 11.48 / 11.52 / 11.51 (x1.018-1.019; torch.bmm 11.48-11.73);
// 8 x 16 rows 6.45 / 6.47 against 6.39 / 6.43 (x0.990) (gemv_ab_rot_session14.json,
// gemv_ab_segwc_spec_session14.json, gemv_ab_segwc_u3_session14.json).
// Measured in session 14 and not kept (same tool, 8 x 512 rows): W through per-thread
// shared-memory slots filled by cp.async, freeing registers for 2 / 3 / 4 steps of x in flight:
// 12.19 / 12.00 / 13.14 against 11.47 (gemv_ab_segw_session14.json); with W through L1, 3 steps
// of x in flight: 12.64 against 11.51 (8 x 16 rows 8.14 against 6.43); the segment lookup left
// out (a probe valid for equal whole-tile segments only): 12.09 against 11.52, slower, as in
// session 8; each tile starting its K walk at a different round (so the wave does not read the
// same columns of all rows at once): 11.62 against 11.48, mm_bf16 M = 16 10.82 against 10.43,
// bmm_fp8 M = 16 6.78 against 7.19 (gemv_ab_rot_session14.json).
#ifndef FI_GEMV_SEGWC
#define FI_GEMV_SEGWC 1
#endif

// Everything a launch needs; passed by value (kernel parameter space), no per-call allocation.
struct GemvParams {
  void* out;
  const void* act;
  const void* w;
  const void* bias;          // [n] or null
  const float* scale_a;      // per-tensor scales or null (1.0)
  const float* scale_b;
  int m, n, k;
  int64_t lda, ldw, ldo;     // row strides (elements)
  int64_t bsa, bsw, bso;     // batch strides (elements), blockIdx.z = batch
  // Segment mode (seg_indptr != null): blockIdx.y enumerates (8 * NT)-row tiles of all segments.
  const int64_t* seg_indptr;
  const int64_t* seg_widx;   // weight per segment, null: segment s uses W[s]
  int num_segs;
  int64_t total_rows;        // rows of x (segment mode)
  // Block-scale mode (bs_a != null): DeepSeek-style fp32 scales, 1 x 128 for A (per row and
  // 128-wide K block), 128 x 128 for W. Element (row, kb) of A's scales at bs_a[row*sam + kb*sak];
  // block (nb, kb) of W's at bs_b[nb*sbn + kb*sbk] (+ sbl per weight matrix).
  const float* bs_a;
  const float* bs_b;
  int64_t sam, sak, sbn, sbk, sbl;
};

// KS > 1 (sm_90 only): the KS CTAs of a cluster (consecutive in x) share one group of RS slabs
// and split K into KS contiguous ranges; their partial sums meet in distributed shared memory.
// XS: the activations are streamed like W (segment mode with one group of W rows, where each
// element of x is read by one CTA only); otherwise they are re-read by every CTA and cached.
template <typename TA, typename TW, typename TD, typename TB, int NT, int RS, int U, bool BLOCK,
          int KS, bool XS>
// Two CTAs per SM keep enough loads in flight; that allows up to 128 registers per thread.
__global__ void __launch_bounds__(kWarps * 32, 2) gemv_kernel(const GemvParams p) {
  static_assert(sizeof(TA) == sizeof(TW), "activation and weight must have the same width");
  static_assert(KS == 1 || (FI_GEMV_SM90 && !BLOCK), "K split across a cluster: sm_90, unscaled");
  static_assert(KS == 1 || KS == 2, "one CTA or a CTA pair along x");
  static_assert(!XS || !BLOCK, "block-scaled units read their activations through the cache");
  constexpr int V = 16 / sizeof(TW);  // elements per 16-byte vector
  constexpr int KSTEP = 4 * V;        // k covered by one warp step (4 lanes across k)
  static_assert(!BLOCK || 128 % KSTEP == 0, "a step must not straddle a 128-wide scale block");
  constexpr int NACC = RS * NT * 4;
  constexpr int TM = 8 * NT;  // rows of a segment tile
  __shared__ float red[kWarps][NACC][32];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int n = p.n, k = p.k;
#if FI_GEMV_PREWAIT
  // Before the wait (so while the previous grid drains), ask L2 for the W vectors of this thread's
  // first K step. Safe whatever the previous grid writes: L2 is where global memory is coherent,
  // so a line it rewrites afterwards is the line the loads below read (they skip L1). H200, N = K
  // = 4096, back-to-back calls on rotating weights, tools/ab_gemv.py in turns against no prefetch
  // (gemv_ab_prewait_modes_session11.json): mm_bf16 M = 1 / 4 / 16 10.35 / 10.64 / 11.15 ->
  // 9.56 / 9.85 / 10.48 us, bmm_fp8 M = 1 / 16 6.06 / 7.31 -> 5.53 / 7.02, block-scaled M = 16
  // 9.67 -> 9.32. Prefetching every step of the first round instead (U steps, up to 12
  // prefetches per thread) made M <= 8 7-12 % slower (only the M = 16 pair gained). The LoRA
  // segment unit's x prefetch below: 8 x 512 rows 12.09 -> 11.55 us, 8 x 16 rows 6.55 -> 6.33
  // (gemv_ab_prewait_segment_session11.json).
  if (FI_GEMV_PDL && p.seg_indptr == nullptr) {
    const TW* wb = static_cast<const TW*>(p.w) + int64_t(blockIdx.z) * p.bsw;
    const int nb = (blockIdx.x / KS) * (16 * RS);
    const int steps = (k + KSTEP - 1) / KSTEP;
    const int s0 = (KS > 1 ? int(blockIdx.x % KS) * ((steps + KS - 1) / KS) : 0) + warp;
    const int kk = s0 * KSTEP + t * V;
#pragma unroll
    for (int r = 0; r < RS; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = nb + r * 16 + h * 8 + g;
        if (row < n && kk < k) asm volatile("prefetch.global.L2 [%0];" ::"l"(wb + int64_t(row) * p.ldw + kk));
      }
  } else if (FI_GEMV_PDL && XS) {
    // Segment mode streams x: its tile's rows are known only after the segment lookup (which
    // reads seg_indptr, so comes after the wait). Tile y holds rows y * TM.. when the segments
    // before it are whole tiles (equal LoRA segments): prefetch those; otherwise the hint is
    // wasted, never wrong.
    const TA* xb = static_cast<const TA*>(p.act);
    const int steps = (k + KSTEP - 1) / KSTEP;
    const int s0 = (KS > 1 ? int(blockIdx.x % KS) * ((steps + KS - 1) / KS) : 0) + warp;
    const int kk = s0 * KSTEP + t * V;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int64_t row = int64_t(blockIdx.y) * TM + j * 8 + g;
      if (row < p.total_rows && kk < k) asm volatile("prefetch.global.L2 [%0];" ::"l"(xb + row * p.lda + kk));
    }
  }
#endif
  if (FI_GEMV_PDL) fi::grid_dependency_wait();  // launched early: the inputs are written after this
  int m = p.m;
  const TA* act = static_cast<const TA*>(p.act);
  const TW* w = static_cast<const TW*>(p.w);
  TD* out = static_cast<TD*>(p.out);
  const float* bs_a = p.bs_a;
  const float* bs_b = p.bs_b;

  if (p.seg_indptr != nullptr) {
    // Find this CTA's segment. Warp 0 reads 32 segments' offsets and weight indices in one
    // round trip, prefix-sums their tile counts with shuffles and picks the segment by ballot
    // (a serial walk costs one dependent L2 read per segment before the first W load).
    __shared__ int64_t seg_row0, seg_wi;
    __shared__ int seg_m;
    if (warp == 0) {
      const int64_t y = blockIdx.y;
      int64_t cum = 0, row0 = -1, wi = 0;
      int mm = 0;
      for (int base = 0; base < p.num_segs; base += 32) {
        const int s = base + lane;
        int64_t b0 = 0, len = 0, wsel = s;
        if (s < p.num_segs) {
          b0 = p.seg_indptr[s];
          len = p.seg_indptr[s + 1] - b0;
          if (p.seg_widx != nullptr) wsel = p.seg_widx[s];
        }
        const int64_t tiles = len > 0 ? (len + TM - 1) / TM : 0;
        int64_t incl = tiles;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int64_t v = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += v;
        }
        const int64_t first = cum + incl - tiles;
        const bool mine = y >= first && y < cum + incl;  // false for empty segments
        const unsigned hit = __ballot_sync(0xffffffffu, mine);
        if (hit != 0) {
          const int src = __ffs(hit) - 1;
          const int64_t r0 = b0 + (y - first) * TM;
          const int my_m = int(min(int64_t(TM), b0 + len - r0));
          row0 = __shfl_sync(0xffffffffu, r0, src);
          mm = __shfl_sync(0xffffffffu, my_m, src);
          wi = __shfl_sync(0xffffffffu, wsel, src);
          break;
        }
        cum += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) {
        seg_row0 = row0;
        seg_wi = wi;
        seg_m = mm;
      }
    }
    __syncthreads();
    const int64_t row0 = seg_row0;
    // A surplus tile: uniform across the CTA and, with KS > 1, across its cluster (the cluster's
    // CTAs share blockIdx.y), so no CTA is left waiting at a cluster barrier.
    if (row0 < 0) return;
    const int64_t wi = seg_wi;
    m = seg_m;
    act += row0 * p.lda;
    out += row0 * p.ldo;
    w += wi * p.bsw;
    if (BLOCK) {
      bs_a += row0 * p.sam;
      bs_b += wi * p.sbl;
    }
  } else {
    const int64_t batch = blockIdx.z;
    act += batch * p.bsa;
    w += batch * p.bsw;
    out += batch * p.bso;
    if (BLOCK) bs_b += batch * p.sbl;
  }
  const int n0 = (blockIdx.x / KS) * (16 * RS);

  const TW* wrow[RS][2];
  bool wok[RS][2];
#pragma unroll
  for (int r = 0; r < RS; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = n0 + r * 16 + h * 8 + g;
      wok[r][h] = row < n;
      wrow[r][h] = w + (wok[r][h] ? int64_t(row) * p.ldw : 0) + t * V;
    }
  const TA* arow[NT];
  bool aok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tok = j * 8 + g;
    aok[j] = tok < m;
    arow[j] = act + (aok[j] ? int64_t(tok) * p.lda : 0) + t * V;
  }

  float acc[RS][NT][4];
#pragma unroll
  for (int r = 0; r < RS; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[r][j][c] = 0.f;

  // This CTA's K steps: all of them, or its rank's contiguous share when K is split (KS > 1).
  int nsteps = (k + KSTEP - 1) / KSTEP;
  int sbeg = 0;
  if (KS > 1) {
    const int per = (nsteps + KS - 1) / KS;
    sbeg = int(blockIdx.x % KS) * per;
    nsteps = min(nsteps, sbeg + per);
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int s0 = sbeg + warp; s0 < nsteps; s0 += kWarps * U) {
    uint4 wv[U][RS][2];
    uint4 av[U][NT];
    // Issue every load of U steps before the first MMA: U * RS * 2 W vectors in flight per thread.
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u * kWarps;
      const int kk = s * KSTEP;
      // k is a multiple of V (checked by the launcher), so a vector is entirely in or out.
      const bool kok = s < nsteps && kk + t * V < k;
#pragma unroll
      for (int r = 0; r < RS; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wv[u][r][h] = !(kok && wok[r][h]) ? zero
                        : (XS && FI_GEMV_SEGWC) ? load_cached(wrow[r][h] + kk)
                                                : load_stream(wrow[r][h] + kk);
#pragma unroll
      for (int j = 0; j < NT; ++j)
        av[u][j] = !(kok && aok[j]) ? zero
                   : XS             ? load_stream(arow[j] + kk)
                                    : load_cached(arow[j] + kk);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (BLOCK) {
        // Scaled partial sums: the two MMAs of one step lie in one 128-wide K block, so they
        // accumulate into a fresh fragment that is scaled by a_scale[token] * b_scale[block].
        const int s = s0 + u * kWarps;
        if (s >= nsteps) continue;  // warp-uniform
        const int kb = (s * KSTEP) / 128;
        float sa[NT][2];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tok = j * 8 + 2 * t + e;
            sa[j][e] = tok < m ? bs_a[int64_t(tok) * p.sam + int64_t(kb) * p.sak] : 0.f;
          }
#pragma unroll
        for (int r = 0; r < RS; ++r) {
          // Rows g and g + 8 of a 16-row slab share one 128-row block (n0 is a multiple of 16).
          const int row = n0 + r * 16;
          const float sb = row < n ? bs_b[int64_t(row / 128) * p.sbn + int64_t(kb) * p.sbk] : 0.f;
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            Mma<TW, TA>::run(c, wv[u][r][0].x, wv[u][r][1].x, wv[u][r][0].y, wv[u][r][1].y,
                             av[u][j].x, av[u][j].y);
            Mma<TW, TA>::run(c, wv[u][r][0].z, wv[u][r][1].z, wv[u][r][0].w, wv[u][r][1].w,
                             av[u][j].z, av[u][j].w);
#pragma unroll
            for (int ci = 0; ci < 4; ++ci) acc[r][j][ci] += c[ci] * (sb * sa[j][ci & 1]);
          }
        }
      } else {
#pragma unroll
        for (int r = 0; r < RS; ++r)
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            Mma<TW, TA>::run(acc[r][j], wv[u][r][0].x, wv[u][r][1].x, wv[u][r][0].y,
                             wv[u][r][1].y, av[u][j].x, av[u][j].y);
            Mma<TW, TA>::run(acc[r][j], wv[u][r][0].z, wv[u][r][1].z, wv[u][r][0].w,
                             wv[u][r][1].w, av[u][j].z, av[u][j].w);
          }
      }
    }
  }

  // Every load issued: the next grid may launch. Triggering at the top of the kernel instead
  // measured the same (tools/ab_gemv.py, gemv_ab_pdl_trigger_session8.json: x0.99-1.04).
  if (FI_GEMV_PDL) fi::launch_dependents();
#pragma unroll
  for (int r = 0; r < RS; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[warp][(r * NT + j) * 4 + c][lane] = acc[r][j][c];
  __syncthreads();

  // With a K split, each CTA of the pair finishes half of the outputs, adding the partner's
  // partial sums read from its shared memory.
  const float* other = nullptr;
  int idx0 = 0, idx1 = NACC * 32;
#if FI_GEMV_SM90
  if constexpr (KS == 2) {
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();  // both CTAs' red is written and visible cluster-wide
    const unsigned rank = cl.block_rank();
    other = cl.map_shared_rank(&red[0][0][0], rank ^ 1u);
    idx0 = int(rank) * (NACC * 16);
    idx1 = idx0 + NACC * 16;
  }
#endif
  float scale = 1.f;
  if (p.scale_a != nullptr) scale *= *p.scale_a;
  if (p.scale_b != nullptr) scale *= *p.scale_b;
  const TB* bias = static_cast<const TB*>(p.bias);
  for (int idx = idx0 + threadIdx.x; idx < idx1; idx += kWarps * 32) {
    const int i = idx >> 5;
    const int ln = idx & 31;
    float sum = 0.f;
#pragma unroll
    for (int wp = 0; wp < kWarps; ++wp) sum += red[wp][i][ln];
    if (KS == 2) {
#pragma unroll
      for (int wp = 0; wp < kWarps; ++wp) sum += other[(wp * NACC + i) * 32 + ln];
    }
    // Accumulator element c of MMA (r, j): W row g + 8 * (c / 2), token 2 * t + c % 2.
    const int c = i & 3;
    const int j = (i >> 2) % NT;
    const int r = (i >> 2) / NT;
    const int row = n0 + r * 16 + (ln >> 2) + 8 * (c >> 1);
    const int tok = j * 8 + 2 * (ln & 3) + (c & 1);
    if (row < n && tok < m) {
      float v = sum * scale;
      if (bias != nullptr) v += to_f32(bias[row]);
      out[int64_t(tok) * p.ldo + row] = from_f32<TD>(v);
    }
  }
#if FI_GEMV_SM90
  if constexpr (KS > 1) cooperative_groups::this_cluster().sync();  // partner done reading red
#endif
}

template <int NT, int RS, int U, bool BLOCK, int KS = 1, bool XS = false>
cudaError_t launch(const GemvParams& p, int64_t l, int64_t tiles_y, cudaStream_t stream) {
  dim3 grid(unsigned(fi::ceil_div<int64_t>(p.n, 16 * RS) * KS), unsigned(tiles_y), unsigned(l));
  auto* kernel = gemv_kernel<FI_TA, FI_TW, FI_TD, FI_TBIAS, NT, RS, U, BLOCK, KS, XS>;
  if constexpr (!FI_GEMV_SM90) {
    kernel<<<grid, kWarps * 32, 0, stream>>>(p);
    return cudaGetLastError();
  } else {
    cudaLaunchAttribute attr[2];
    unsigned na = 0;
    if (FI_GEMV_PDL) {
      attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[na++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (KS > 1) attr[na++] = fi::cluster_attribute(KS);
    return fi::launch_ex(kernel, grid, dim3(kWarps * 32), 0, stream, attr, na, p);
  }
}

// Picks the instantiation: NT = token tiles of 8 (M <= 8 or <= 16); two 16-row slabs per CTA
// halve the activation re-reads once there are enough CTAs for every SM, else one slab per CTA
// keeps all SMs streaming; U = steps in flight, bounded by the 128-register budget.
// FI_GEMV_U8: U of the unscaled one-slab M <= 8 instantiation (the shape of N = 4096 decode
// layers); the bench routine mm_bf16's option u8=N builds others for A/B (16-bit weights). H200,
// N = K = 4096 bf16 (mm_bf16_ab_gemv_*.json): U = 6 takes M = 1 / 4 from 10.90 / 11.22 us (U = 4)
// to 10.54 / 10.77 (8: 11.20 / 11.07). M = 16 stayed at 12.2-12.6 us with U = 4, 6 or 8, so it
// keeps 4, as do the block-scaled units, whose per-step scale registers spill above it.
#ifndef FI_GEMV_U8
#define FI_GEMV_U8 6
#endif
// FI_GEMV_M16: unit of the unscaled M = 9..16 case when one 16-row slab per CTA is needed to fill
// the GPU (N = 4096: 256 CTAs). 1: each CTA reads all 16 activation rows over the whole K, so the
// activations cross from L2 to the SMs once per 16 W rows (32 MB at N = K = 4096, as much as W).
// 2 (sm_90 default): 32 W rows per 2-CTA cluster, each CTA taking half of K, which halves that
// traffic; the pair adds its partial sums through distributed shared memory. H200, M = 16,
// N = K = 4096 bf16 (mm_bf16_ab_gemv_m16_*.json): 1: 13.24 / 13.34 us, 2: 12.06 / 12.21 in two
// calls; measured and dropped: the pair with 3 K steps in flight 13.82, 64 W rows per 4-CTA
// cluster with one step in flight 19.25.
#ifndef FI_GEMV_M16
#define FI_GEMV_M16 (FI_GEMV_SM90 ? 2 : 1)
#endif
template <bool BLOCK>
cudaError_t dispatch(const GemvParams& p, int64_t l, int64_t tiles_y, int max_m,
                     cudaStream_t stream) {
  // fp8 weights keep U = 4 (bmm_fp8 M = 1, N = K = 4096: 6.59 us at 4, 7.71 at 6, where a
  // warp's 8 K steps split 6 + 2 instead of 4 + 4).
  constexpr bool kFp8 = sizeof(FI_TW) == 1;
  constexpr int kU8 = (BLOCK || kFp8) ? 4 : FI_GEMV_U8;
  // N <= 16 (LoRA shrink) fills one slab: a second one would only add masked work.
  const bool two_slabs =
      p.n > 16 && fi::ceil_div<int64_t>(p.n, 32) * l * tiles_y >= fi::sm_count();
  if (max_m <= 8)
    return two_slabs ? launch<1, 2, 3, BLOCK>(p, l, tiles_y, stream)
                     : launch<1, 1, kU8, BLOCK>(p, l, tiles_y, stream);
  if (two_slabs) return launch<2, 2, 2, BLOCK>(p, l, tiles_y, stream);
#if FI_GEMV_SM90
  // The pair serves the plain GEMM (tiles_y == 1) only; segment mode has its own N <= 16 unit
  // (fi_gemv_segment). fp8 weights keep one CTA per 16 rows: their pair instantiation spills.
  if constexpr (!BLOCK && !kFp8 && FI_GEMV_M16 == 2) {
    if (tiles_y == 1) return launch<2, 2, 2, false, 2>(p, l, tiles_y, stream);
  }
#endif
  return launch<2, 1, 4, BLOCK>(p, l, tiles_y, stream);
}

bool aligned16(const void* a, const void* b) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0;
}

}  // namespace

constexpr int kV = 16 / sizeof(FI_TW);
constexpr int64_t kMax32 = int64_t(1) << 31;

// m <= 16; k a multiple of 16 bytes of elements; rows of A and W 16-byte aligned (checked in
// Python, re-checked here as a cheap guard against out-of-bounds vector loads).
FI_EXPORT int fi_gemv(void* out, const void* act, const void* w, const void* bias,
                      const void* scale_a, const void* scale_b, int64_t m, int64_t n, int64_t k,
                      int64_t l, int64_t lda, int64_t ldw, int64_t ldo, int64_t bsa, int64_t bsw,
                      int64_t bso, cudaStream_t stream) {
  if (m < 0 || m > 16 || k % kV != 0 || lda % kV != 0 || ldw % kV != 0 || !aligned16(act, w) ||
      n >= kMax32 || k >= kMax32 || l > 65535)
    return (int)cudaErrorInvalidValue;
  if (m == 0 || n == 0 || l == 0) return 0;
  GemvParams p{};
  p.out = out; p.act = act; p.w = w; p.bias = bias;
  p.scale_a = static_cast<const float*>(scale_a);
  p.scale_b = static_cast<const float*>(scale_b);
  p.m = int(m); p.n = int(n); p.k = int(k);
  p.lda = lda; p.ldw = ldw; p.ldo = ldo; p.bsa = bsa; p.bsw = bsw; p.bso = bso;
  return (int)dispatch<false>(p, l, 1, int(m), stream);
}

// FI_GEMV_SEG: unit of the unscaled segment GEMM with N <= 16 (LoRA shrink), where x is the
// streamed operand and each CTA re-reads its segment's W from L2 for every 16 rows of x. 1: 16-row
// tiles, one CTA each. 2 (sm_90 default): 32-row tiles, each split over K between the two CTAs of
// a cluster, which halves the W traffic per row of x at the same CTA count. H200, 8 segments of
// 16 / 512 rows, 4096 -> 16 (segment_gemm_ab_seg*.json): 1: 7.73 / 14.95 us, 2: 7.07 / 13.61.
#ifndef FI_GEMV_SEG
#define FI_GEMV_SEG (FI_GEMV_SM90 ? 2 : 1)
#endif

// Segment GEMM: rows seg_indptr[s] .. seg_indptr[s+1] of x times W[seg_widx[s]]^T (seg_widx null:
// W[s]). x is [total_rows, k], W is [*, n, k] with batch stride bsw, out is [total_rows, n].
// Rows outside every segment are not written. Graph-safe: the grid is sized from total_rows and
// num_segs (host values); segment lengths are read on the device. With bs_a != null the block
// scales apply (bs_a rows indexed like x's rows, sbl = stride between weights' scale blocks).
FI_EXPORT int fi_gemv_segment(void* out, const void* x, const void* w, const void* seg_indptr,
                              const void* seg_widx, const void* bs_a, const void* bs_b,
                              int64_t total_rows, int64_t num_segs, int64_t n, int64_t k,
                              int64_t ldx, int64_t ldw, int64_t ldo, int64_t bsw, int64_t sam,
                              int64_t sak, int64_t sbn, int64_t sbk, int64_t sbl,
                              cudaStream_t stream) {
  if (k % kV != 0 || ldx % kV != 0 || ldw % kV != 0 || bsw % kV != 0 || !aligned16(x, w) ||
      n >= kMax32 || k >= kMax32 || num_segs >= kMax32)
    return (int)cudaErrorInvalidValue;
  // sum_s ceil(len_s / T) <= floor(total / T) + num_segs for T-row tiles; surplus CTAs exit
  // at once.
  const int64_t tiles = total_rows / 16 + num_segs;
  if (tiles == 0 || n == 0) return 0;
  if (tiles > 65535) return (int)cudaErrorInvalidConfiguration;
  GemvParams p{};
  p.out = out; p.act = x; p.w = w;
  p.m = 16; p.n = int(n); p.k = int(k);
  p.lda = ldx; p.ldw = ldw; p.ldo = ldo; p.bsw = bsw;
  p.seg_indptr = static_cast<const int64_t*>(seg_indptr);
  p.seg_widx = static_cast<const int64_t*>(seg_widx);
  p.num_segs = int(num_segs);
  p.total_rows = total_rows;
  p.bs_a = static_cast<const float*>(bs_a);
  p.bs_b = static_cast<const float*>(bs_b);
  p.sam = sam; p.sak = sak; p.sbn = sbn; p.sbk = sbk; p.sbl = sbl;
#if FI_GEMV_SM90
  // 16-bit only: fp8 segments always carry block scales (group_gemm_fp8_nt_groupwise).
  if constexpr (FI_GEMV_SEG == 2 && sizeof(FI_TW) == 2) {
    if (bs_a == nullptr && n <= 16)
      return (int)launch<4, 1, 2, false, 2, true>(p, 1, total_rows / 32 + num_segs, stream);
  }
#endif
  return (int)(bs_a != nullptr ? dispatch<true>(p, 1, tiles, 16, stream)
                               : dispatch<false>(p, 1, tiles, 16, stream));
}

// Block-scaled GEMM for M <= 16 (gemm_fp8_nt_groupwise at decode shapes): out = sum over
// 128-wide K blocks of (A_blk @ W_blk^T) * a_scale[m, kb] * b_scale[n / 128, kb].
FI_EXPORT int fi_gemv_blockscaled(void* out, const void* act, const void* w, const void* bs_a,
                                  const void* bs_b, int64_t m, int64_t n, int64_t k, int64_t lda,
                                  int64_t ldw, int64_t ldo, int64_t sam, int64_t sak,
                                  int64_t sbn, int64_t sbk, cudaStream_t stream) {
  if (m < 0 || m > 16 || k % kV != 0 || lda % kV != 0 || ldw % kV != 0 || !aligned16(act, w) ||
      n >= kMax32 || k >= kMax32 || bs_a == nullptr || bs_b == nullptr)
    return (int)cudaErrorInvalidValue;
  if (m == 0 || n == 0) return 0;
  GemvParams p{};
  p.out = out; p.act = act; p.w = w;
  p.m = int(m); p.n = int(n); p.k = int(k);
  p.lda = lda; p.ldw = ldw; p.ldo = ldo;
  p.bs_a = static_cast<const float*>(bs_a);
  p.bs_b = static_cast<const float*>(bs_b);
  p.sam = sam; p.sak = sak; p.sbn = sbn; p.sbk = sbk;
  return (int)dispatch<true>(p, 1, 1, int(m), stream);
}
