// Batch decode attention on tensor cores (mma.sync m16n8k16, SM80+), for GQA groups of up to 8
// query heads and head_dim 64/128, without RoPE (that runs on decode.cu).
//
// Why: the CUDA-core kernel spends ~80 instructions per (token, kv head) on FMAs, dot-product
// shuffles and conversions, close to the issue budget of an SM streaming K/V at 4.5 TB/s. Here a
// warp handles 16 tokens per step with 32 MMAs and ~14 instructions per token.
//
// Fragment plan (row = query head, padded to 16; rows >= GH and 8..15 are zero):
//   S[h, t] = Q[h, :] . K[t, :]    A = Q (registers for the whole kernel), B = K^T, 2 n-tiles of
//                                  8 tokens. The k index order over head_dim is free as long as A
//                                  and B agree: lane (g = lane/4, c = lane%4) takes its local
//                                  elements 4s + {0,1} | {2,3} for k-step s out of a D/4-element
//                                  slice of token g (16-byte pieces, see "Sector layout"): plain
//                                  loads straight from the page into registers, no shared memory.
//   O^T[d, h] += V^T[d, t] P^T[t, h]  computed transposed so that the 8 MMA columns are the query
//                                  heads (no padded rows, half the MMAs and accumulators of O = PV):
//                                  B = P^T is exactly the S accumulator layout of row g; A = V^T
//                                  with the row order over head_dim free: rows g, g+8 of m-tile i
//                                  are lane g's local V elements 2i, 2i+1; a lane reads a D/8-
//                                  element slice of each of its 4 tokens (2c, 2c+1, 8+2c, 9+2c) and
//                                  pairs them with byte permutes. The per-head softmax correction
//                                  of columns 2c, 2c+1 comes from the lanes owning those S rows.
// fp8 caches are widened to f16 in registers (cvt.f16x2.e4m3x2 is one instruction) and the MMAs
// run in f16. Q is not pre-scaled (it stays exact in the MMA type); S is scaled in fp32.
//
// Variant 3 (FI_MMA_VARIANT=3) streams K/V through a per-warp cp.async ring in shared memory
// instead of loading them into registers; see "Shared-memory ring" below.
#include <type_traits>

#include "fi/common.cuh"
#include "fi/fp8_widen.cuh"
#include "fi/math.cuh"
#include "fi/pipeline.cuh"
#include "fi/vec.cuh"

#include "decode_args.h"
#include "decode_common.cuh"

namespace {

using QT = FI_Q;
using KVT = FI_KV;
constexpr int D = FI_HEAD_DIM;
constexpr int GH = FI_GH;
constexpr int POS = FI_POS;
constexpr bool SOFTCAP = FI_SOFTCAP != 0;
static_assert(POS != 1, "ROPE_LLAMA runs on the CUDA-core kernel");
static_assert(D == 64 || D == 128, "head_dim 64 or 128");
static_assert(GH >= 1 && GH <= 8, "at most 8 query heads per CTA (MMA rows 0..7)");

constexpr bool KV8 = sizeof(KVT) == 1;
using MT = std::conditional_t<KV8, __half, KVT>;  // MMA operand type
// How K/V reach the registers (spec.py picks from H200 measurements; the decode bench routine's
// option mma_variant=N builds the other one for A/B runs):
//   0  register tiles: one 16-token tile (two for fp8) per warp iteration, loads issued before any
//      use (16-bit caches on GPUs other than sm_90);
//   3  a per-warp cp.async ring of STAGES one-tile slots in shared memory, the next STAGES tiles in
//      flight while the warp computes the current one (fp8 caches: 548 us vs 638 us for 0; on
//      sm_90 16-bit caches too, at 2 CTAs per SM: x1.016-1.036 over 0 on every swept batch).
// Numbers 1 (an L2 bulk prefetch of the next tile) and 2 (two 16-bit tiles per iteration at 2 CTAs
// per SM) were measured slower for both dtypes and removed; their results stay in
// benchmarks/results/h200/BatchDecodeWithPagedKVCacheWrapper_ab_*.json.
#ifndef FI_MMA_VARIANT
#define FI_MMA_VARIANT 0
#endif
#ifndef FI_PAGE_AHEAD
#define FI_PAGE_AHEAD 1  // variant 0: page ids one iteration ahead (see `lookup` in the kernel)
#endif
constexpr int VARIANT = FI_MMA_VARIANT;
static_assert(VARIANT == 0 || VARIANT == 3, "FI_MMA_VARIANT is 0 or 3");
// Warps per CTA: 4 in every shipped module. FI_MMA_NW builds (A/B only: tools/ab_decode.py
// MMA_NW=8,MMA_CTAS=1, one CTA of 8 warps per SM at the same 252 registers) were slower where the
// plan has one CTA per SM, so twice the copies in flight per SM do not shorten those grids (H100,
// results/h100/decode_ab_session34_nw8.json: b1 x 32768 x0.920, b1 x 8192 x0.806, b2 x 4096 x0.794;
// b16 x0.997, b64 x1.004; with 3 ring slots per warp x0.73-0.995).
#ifndef FI_MMA_NW
#define FI_MMA_NW 4
#endif
constexpr int NW = FI_MMA_NW;
constexpr int KD = D / 4;       // K elements per lane per token
constexpr int VD = D / 8;       // V elements per lane per token (= PV n-tiles)
constexpr int KSTEPS = D / 16;
constexpr int KBYTES = KD * int(sizeof(KVT));
constexpr int TILES = (KV8 && VARIANT != 3) ? 2 : 1;  // variant 3: see the ring
// Page ids one iteration ahead for one-tile iterations (16-bit caches); fp8's two-tile variant 0
// would spill with them (28 bytes at 168 registers) and keeps the in-iteration lookup.
constexpr bool AHEAD = FI_PAGE_AHEAD && TILES == 1;
constexpr int VBYTES = VD * int(sizeof(KVT));

// Shared-memory ring (variant 3). Each warp owns STAGES slots of one tile: 16 K rows then 16 V
// rows of its kv head (ROW bytes each; 8 KB per bf16 tile at head_dim 128, 4 KB for fp8, which
// also takes one tile per iteration here: its bytes in flight are in the ring, not in registers).
// Copies: CPR lanes cover one row (lane l copies 16-byte chunk l % CPR of rows l / CPR + RPI i of
// both blocks; one page lookup per row serves K and V), so each instruction asks L2 for whole
// 128-byte lines. Copying 64 bytes of 8 rows per instruction instead (variant 0's K pattern) made
// the fp8 kernel L2-bound: ncu at b128 x kv8192 showed L2 at 93 % of its throughput with DRAM at
// 79 % (twice the L2 requests per byte); whole lines measured 541.6 against 570.6 us on the H200
// (decode_ab_fp8_lazy_session9.json; ncu: DRAM 84 %, ncu_decode_fp8_copy1_session9.txt). Once the
// tile has landed, lanes read variant 0's fragments (K chunks 4j + c of rows g, g + 8; V chunks
// g (+ 8) of rows 2c + {0, 1} (+ 8)), so the MMA code is shared. The default depth is a 48 KB ring
// per CTA (3 slots of 4 KB per warp for fp8 at head_dim 128: 538-542 us against 547 for the 64 KB
// ring and 555 for 96 KB at 2 CTAs per SM, decode_ab_copy_session9.json; 2 slots measured the same,
// and 4 CTAs per SM at 128 registers no faster, decode_ab_fp8_stages_session9.json); 3 CTAs fit
// an SM (the launch bound) on sm_90 and sm_80. The epilogue's merge arrays reuse the ring.
#ifndef FI_MMA_STAGES
#define FI_MMA_STAGES 0  // 0: the 48 KB ring (at least 2 slots); N: N slots per warp (mma_stages=N)
#endif
constexpr int ROW = D * int(sizeof(KVT));
constexpr int TILE_BYTES = 32 * ROW;
constexpr int CPR = ROW / 16;       // 16-byte chunks per row
constexpr int RPI = 32 / CPR;       // rows per copy instruction
constexpr int CROWS = 16 / RPI;     // rows a lane copies (and looks up) per tile
static_assert(CPR <= 32 && 16 % RPI == 0, "whole rows per copy instruction");
constexpr int STAGES_48K = 48 * 1024 / (NW * TILE_BYTES);
constexpr int STAGES = FI_MMA_STAGES > 0 ? FI_MMA_STAGES : STAGES_48K > 2 ? STAGES_48K : 2;
static_assert(STAGES >= 1 && STAGES <= 8, "1..8 ring slots per warp");
static_assert(VARIANT != 3 || TILES == 1, "the ring holds one 16-token tile per slot");
constexpr int RING_BYTES = NW * STAGES * TILE_BYTES;

struct MergeSmem {  // the epilogue's exchange of the NW warp states
  float o[NW][GH][D];
  float m[NW][GH], l[NW][GH];
};
constexpr int SMEM_BYTES =  // dynamic shared memory per CTA (variant 0 uses static arrays only)
    VARIANT != 3 ? 0 : RING_BYTES > int(sizeof(MergeSmem)) ? RING_BYTES : int(sizeof(MergeSmem));
// FI_MMA_CTAS CTAs (4 warps each) per SM at most: 3 by default. The ring on a 16-bit cache is
// built with 2 (spec.RING_16BIT_CTAS): at 3 its 168 registers spilled 24 bytes. Variant 3 also
// needs its shared memory per CTA: an sm_90 SM has 228 KB, 1 KB of it reserved per CTA (the launch
// bound only caps registers; the planner reads the residency from the occupancy query).
#ifndef FI_MMA_CTAS
#define FI_MMA_CTAS 3
#endif
constexpr int CTAS_BY_SMEM = VARIANT == 3 ? 228 * 1024 / (SMEM_BYTES + 1024) : FI_MMA_CTAS;
constexpr int CTAS_PER_SM = CTAS_BY_SMEM < FI_MMA_CTAS ? CTAS_BY_SMEM : FI_MMA_CTAS;
static_assert(SMEM_BYTES <= 227 * 1024 && CTAS_PER_SM >= 1, "the ring does not fit one SM");

// Sector layout. A lane's K slice (KD elements of a token) and V slice (VD elements) are not
// contiguous: they are 16-byte pieces interleaved with the other lanes of the same row, so each
// load instruction of the warp covers whole 32-byte sectors (4 lanes x 16 B of one K row, 8 lanes
// x 16 B of one V row). With contiguous slices every instruction would touch each sector with
// half its bytes and the next instruction the other half: twice the L2 requests per DRAM byte,
// which the H200 showed as L2 at 93 % of its throughput while DRAM sat at 86 %.
//   K: lane c's element e is d = (e / PE) * 4 PE + c PE + e % PE
//   V: lane g's element e is d = (e / VP) * 8 VP + g VP + e % VP
// Q uses the K map (the contraction order is free as long as A and B agree); the O^T rows use the
// V map in the epilogue.
constexpr int PE = 16 / int(sizeof(KVT));  // elements per 16-byte piece
constexpr int VP = VD < PE ? VD : PE;      // fp8 at head_dim 64: one 8-byte piece per V slice
static_assert(KD % PE == 0 && VD % VP == 0, "slices are whole pieces");
__device__ __forceinline__ int k_dim(int c, int e) { return (e / PE) * 4 * PE + c * PE + e % PE; }
__device__ __forceinline__ int v_dim(int g, int e) { return (e / VP) * 8 * VP + g * VP + e % VP; }

// Byte offset of 16-byte chunk `ch` of row r (0..15) in a 16-row K or V block of the ring.
// Reads go 8 lanes at a time for 16-byte loads (lanes 8k..8k+7), 16 for 8-byte ones; a phase is
// conflict-free when its lanes hit distinct 16-byte (8-byte) bank slots of a 128-byte line:
//   K phase: rows 2k, 2k + 1 (+ 8), chunks 4j + c  (c = 0..3)
//   V phase: rows b, b + 2, b + 4, b + 6 (b = 0, 1, 8 or 9), chunks 2k, 2k + 1 (+ 8)
// Unswizzled rows of 128 or 256 bytes start on the same banks: K would be 2-way, V 4-way. Rows of
// >= 128 bytes XOR the chunk's bits 1..2 with (r1, r0 ^ r2): bit 2 differs between rows 2k and
// 2k + 1 (K reads the two 64-byte halves of the line), bits 1..2 differ between the 4 V rows of
// one parity (their chunk pairs spread over the line). 64-byte rows (fp8, head_dim 64) hold two
// rows per line: row r goes to slot r ^ r1 so that rows 2k and 2k + 1 share a line (K) and the 4
// V rows of a phase fall 2 per line half, where the chunk XOR 2 r2 splits the halves' 8-byte
// slots between them. A cp.async phase writes 8 chunks of one row (two rows' 4 at 64 bytes): distinct
// slots, conflict-free at every row size (tests/decode/test_mma_ring_layout.py checks all of it).
__device__ __forceinline__ int ring_off(int r, int ch) {
  if constexpr (ROW >= 128) {
    const int swz = (r & 2) | (((r ^ (r >> 2)) & 1) << 2);
    return r * ROW + ((ch ^ swz) << 4);
  } else {
    return (r ^ ((r >> 1) & 1)) * ROW + ((ch ^ ((r >> 1) & 2)) << 4);
  }
}

// Shared-memory loads by 32-bit shared address. "memory" keeps them between the ring barriers in
// the compiler's order (the cp.async refill of their stage follows them).
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a) : "memory");
  return r;
}
__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 r;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(a) : "memory");
  return r;
}

using Params = fi_attn::DecodeParams<QT, KVT>;

// FI_DECODE_TRACE=N (diagnostic builds only, e.g. tools/ab_decode.py style A/B switches): thread 0
// of each of the first N CTAs records %globaltimer (ns) at entry, once its first tiles are issued
// (after the PDL wait), after its main loop and at exit, and its SM; fi_decode_trace_read copies
// the last launch's records out. Off (0) in every shipped build.
#ifndef FI_DECODE_TRACE
#define FI_DECODE_TRACE 0
#endif
#if FI_DECODE_TRACE
__device__ unsigned long long fi_decode_trace[FI_DECODE_TRACE][5];
__device__ __forceinline__ void trace(int what) {
  if (threadIdx.x == 0 && blockIdx.x < FI_DECODE_TRACE) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    fi_decode_trace[blockIdx.x][what] = t;
    if (what == 0) fi_decode_trace[blockIdx.x][4] = fi::sm_id();
  }
}
#else
__device__ __forceinline__ void trace(int) {}
#endif

// Element offset of row `of` of page `pg` with 32-bit strides (the launcher rejects larger
// ones): two widening 32 x 32 -> 64-bit multiplies instead of two 64-bit products. `of` can be
// large (single decode puts a whole request in one page), so its product stays 64-bit too.
__device__ __forceinline__ int64_t row_off(int pg, int of, int64_t sp, int64_t st) {
  return int64_t(pg) * int(sp) + int64_t(of) * int(st);
}

// BYTES of cache data as raw 32-bit words, loaded with 16-byte (or 8-byte) streaming loads. The
// 16-byte pieces of a lane's slice are `stride` elements apart (see the sector layout below).
template <int BYTES>
struct Raw {
  static_assert(BYTES % 8 == 0, "8-byte granularity");
  uint32_t w[BYTES / 4];
  __device__ __forceinline__ void load(const KVT* ptr, int stride) {
    if constexpr (BYTES % 16 == 0) {
#pragma unroll
      for (int i = 0; i < BYTES / 16; ++i) {
        const uint4 v = fi_attn::ldg_stream<uint4>(ptr + i * stride);
        w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
      }
    } else {
      static_assert(BYTES == 8, "an 8-byte slice is one piece");
      const uint2 v = fi_attn::ldg_stream<uint2>(ptr);
      w[0] = v.x; w[1] = v.y;
    }
  }
  // Piece i (16 bytes, or the one 8-byte piece) from shared address a.
  __device__ __forceinline__ void load_shared(int i, uint32_t a) {
    if constexpr (BYTES % 16 == 0) {
      const uint4 v = lds128(a);
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    } else {
      const uint2 v = lds64(a);
      w[0] = v.x; w[1] = v.y;
    }
  }
};

// Raw cache words -> pairs of MT elements (element 2i in the low half of word i).
template <int N>
__device__ __forceinline__ void to_pairs(const Raw<N * int(sizeof(KVT))>& r, uint32_t (&out)[N / 2]) {
  if constexpr (!KV8) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) out[i] = r.w[i];
  } else {
    // fi/fp8_widen.cuh to f16: e5m2 by one byte permute per pair, e4m3 by the paired cvt (one
    // instruction on sm_89+); exact for every finite value.
    constexpr bool kE5m2 = std::is_same_v<KVT, __nv_fp8_e5m2>;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      out[2 * i] = fi::widen_fp8x2<false, kE5m2, false>(r.w[i]);
      out[2 * i + 1] = fi::widen_fp8x2<false, kE5m2, true>(r.w[i]);
    }
  }
}

__device__ __forceinline__ uint32_t pack(float a, float b) {
  if constexpr (std::is_same_v<MT, __half>) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// d += A(16x16, row) * B(16x8, col), fp32 accumulators.
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<MT, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

#if FI_MMA_VARIANT == 3
// One warp's cp.async ring (see "Shared-memory ring"). The warp's n-th tile (tokens lo +
// 16 (warp + NW n) + 0..15) goes to slot n % STAGES and is commit group n of every lane.
extern __shared__ __align__(128) uint8_t ring_smem[];

struct WarpRing {
  const KVT* kc;  // the lane's first chunk of the kv head's K and V rows
  const KVT* vc;
  uint32_t base;  // shared address of the warp's slot 0
  int page_lo, hi, g, c, slot = 0;
  int r0, ch;     // the lane's first copied row and its chunk
  // CTA-uniform: pages of a multiple of 16 tokens and a range starting on a 16-token boundary, so
  // a full tile lies in one page: one page lookup per tile and rows at fixed strides from it,
  // instead of a lookup and an offset per copied row. fp8 b128 x kv8192: 543.6 against 567.4 us
  // (paired per-round x1.044, decode_ab_fp8_page_tile_session9.json), 529.5 against 534.5 under ncu.
  bool paged16;

  // Starts tiles 0..STAGES-1, one group each: a tile past `hi` commits an empty group, so every
  // lane commits the same groups and the wait counts hold at the tail.
  __device__ __forceinline__ WarpRing(const Params& p, int kvh, int page_lo_, int lo, int hi_, int warp, int g_,
                                      int c_)
      : base(static_cast<uint32_t>(__cvta_generic_to_shared(ring_smem)) + warp * (STAGES * TILE_BYTES)),
        page_lo(page_lo_), hi(hi_), g(g_), c(c_) {
    const int lane = 4 * g_ + c_;
    r0 = lane / CPR;
    ch = lane % CPR;
    kc = p.k + kvh * p.k_sh + ch * PE;
    vc = p.v + kvh * p.v_sh + ch * PE;
    paged16 = p.page_size % 16 == 0 && lo % 16 == 0;
    int pg[STAGES][CROWS], of[STAGES][CROWS];
    bool one[STAGES];
    // PDL (DecodeFlag): page ids that plan() wrote are looked up before the wait for the previous
    // grid, so the first copies issue as soon as it returns; the user's own page ids after it.
    if (!(p.early & kDecodeIndicesEarly)) fi::grid_dependency_wait();
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {  // every page lookup first: their loads overlap
      const int b = lo + 16 * (warp + NW * s);
      one[s] = b < hi && lookup(p, b, pg[s], of[s]);
    }
    fi::grid_dependency_wait();  // K/V (and q, out) may be the previous grid's work: not before this
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      if (lo + 16 * (warp + NW * s) < hi) copy(p, base + s * TILE_BYTES, pg[s], of[s], one[s]);
      fi::cp_async_commit();
    }
  }

  // Row i of the lane's copied rows.
  __device__ __forceinline__ int crow(int i) const { return r0 + RPI * i; }

  // Pages of the lane's rows of the tile at tb; rows past `hi` copy row hi - 1 (their scores
  // are masked, as in variant 0). Returns true (warp-uniform) when the whole tile lies in one
  // page and before hi: then only pg[0] / of[0] are set, for the lane's first row.
  __device__ __forceinline__ bool lookup(const Params& p, int tb, int (&pg)[CROWS], int (&of)[CROWS]) const {
    if (paged16 && tb + 16 <= hi) {
      pg[0] = int(fi_attn::page_of(p, page_lo, tb + r0, of[0]));
      return true;
    }
#pragma unroll
    for (int i = 0; i < CROWS; ++i) pg[i] = int(fi_attn::page_of(p, page_lo, min(tb + crow(i), hi - 1), of[i]));
    return false;
  }

  // The lane's chunks of its K and V rows into the slot at shared address st.
  __device__ __forceinline__ void copy(const Params& p, uint32_t st, const int (&pg)[CROWS], const int (&of)[CROWS],
                                       bool one) const {
    if (one) {  // rows r0 + RPI i of one page: fixed token strides from the first
      const KVT* ks = kc + row_off(pg[0], of[0], p.k_sp, p.k_st);
      const KVT* vs = vc + row_off(pg[0], of[0], p.v_sp, p.v_st);
#pragma unroll
      for (int i = 0; i < CROWS; ++i) {
        const uint32_t dst = st + ring_off(crow(i), ch);
        fi::cp_async_16(dst, ks + int64_t(RPI * i) * int(p.k_st));
        fi::cp_async_16(dst + 16 * ROW, vs + int64_t(RPI * i) * int(p.v_st));
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < CROWS; ++i) {
      const KVT* ks = kc + row_off(pg[i], of[i], p.k_sp, p.k_st);
      const KVT* vs = vc + row_off(pg[i], of[i], p.v_sp, p.v_st);
      const uint32_t dst = st + ring_off(crow(i), ch);
      fi::cp_async_16(dst, ks);
      fi::cp_async_16(dst + 16 * ROW, vs);
    }
  }

  // The fragments of the tile at tb (the warp's next one) into registers, then its slot refilled
  // with the tile STAGES iterations ahead, so STAGES tiles stay in flight while the warp
  // computes. The refill's page lookups are issued first: they load during the wait.
  __device__ __forceinline__ void next(const Params& p, int tb, Raw<KBYTES> (&rk)[2], Raw<VBYTES> (&rv)[4]) {
    const int nb = tb + STAGES * NW * 16;
    int pg[CROWS] = {}, of[CROWS] = {};
    const bool one = nb < hi && lookup(p, nb, pg, of);
    fi::cp_async_wait<STAGES - 1>();  // this lane's copies of tile n (group n) have landed
    __syncwarp();                     // ... and every lane's are visible to the whole warp
    const uint32_t kt = base + slot * TILE_BYTES, vt = kt + 16 * ROW;
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // K chunks 4j + c of rows g, g + 8 (this lane's own copies)
#pragma unroll
      for (int j = 0; j < ROW / 64; ++j) rk[i].load_shared(j, kt + ring_off(8 * i + g, 4 * j + c));
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // V of tokens 2c, 2c + 1, 8 + 2c, 9 + 2c: the V map's pieces of g
      const int r = 2 * c + (j & 1) + 8 * (j >> 1);
      if constexpr (VBYTES % 16 == 0) {
#pragma unroll
        for (int m = 0; m < VBYTES / 16; ++m) rv[j].load_shared(m, vt + ring_off(r, g + 8 * m));
      } else {  // one 8-byte piece per row (fp8, head_dim 64): bytes 8g..8g+7
        rv[j].load_shared(0, vt + ring_off(r, g >> 1) + 8 * (g & 1));
      }
    }
    __syncwarp();  // every lane has read the slot before any lane's copies overwrite it
    if (nb < hi) copy(p, kt, pg, of, one);
    fi::cp_async_commit();
    slot = slot + 1 < STAGES ? slot + 1 : 0;
  }
};
#endif

// 3 CTAs (12 warps) per SM keep enough 16-byte loads in flight; the kernel needs <= 168 registers.
// One work unit (see decode_work): the CTA's KV range of one request and head group, merged into
// out (or its partial slot).
__device__ __forceinline__ void attend(const Params& p, const fi_attn::DecodeWork& wk) {
  const int kvh = wk.kvh, qh0 = wk.qh0, req = wk.req, part = wk.part;
  const int page_lo = wk.page_lo, qpos = wk.qpos, lo = wk.lo, hi = wk.hi;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;

#if FI_MMA_VARIANT == 3
  WarpRing ring(p, kvh, page_lo, lo, hi, warp, g, c);  // starts the warp's first STAGES tiles
  trace(1);
#else
  fi::grid_dependency_wait();  // PDL: the register tiles read no page ids before it
#endif

  // A fragments of Q for row g (head qh0 + g): qa[s][0] = d c*KD + 4s + {0,1}, qa[s][1] = + {2,3}.
  uint32_t qa[KSTEPS][2];
  if (g < GH) {
    const QT* qp = p.q + req * p.q_sb + (qh0 + g) * p.q_sh;
#pragma unroll
    for (int i = 0; i < KD / 8; ++i) {
      fi::vec_t<QT, 8> v;  // local elements 8i..8i+7: one run of the K map (PE >= 8)
      v.load(qp + k_dim(c, 8 * i));
      qa[2 * i][0] = pack(fi::to_float(v[0]), fi::to_float(v[1]));
      qa[2 * i][1] = pack(fi::to_float(v[2]), fi::to_float(v[3]));
      qa[2 * i + 1][0] = pack(fi::to_float(v[4]), fi::to_float(v[5]));
      qa[2 * i + 1][1] = pack(fi::to_float(v[6]), fi::to_float(v[7]));
    }
  } else {
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) qa[s][0] = qa[s][1] = 0u;
  }
  float slope = 0.f;
  if constexpr (POS == 2) slope = fi_attn::alibi_slope(min(qh0 + g, p.hq - 1), p.hq) * fi::kLog2e;

  // O^T accumulators of m-tile i: [0] (d_i, head 2c), [1] (d_i, 2c+1), [2] (d_i + 1, 2c),
  // [3] (d_i + 1, 2c+1) with d_i = v_dim(g, 2i).
  constexpr int MTILES = D / 16;
  float o[MTILES][4];
#pragma unroll
  for (int i = 0; i < MTILES; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m = fi::kNegInf, l = 0.f;  // row g: m is uniform over the 4 lanes of the row, l partial

#if FI_MMA_VARIANT != 3
  const KVT* kb = p.k + kvh * p.k_sh + c * PE;
  const KVT* vb = p.v + kvh * p.v_sh + g * VP;
  // Page of each K row (2 per tile) and V token (4 per tile) this lane loads. With FI_PAGE_AHEAD
  // the next iteration's are read right after this iteration's K/V loads are issued, so a K/V load
  // waits for one memory round trip instead of a page-table read and then the K/V read; 0 reads
  // them at the top of each iteration (the round-1 order, for A/B). Only the page ids are carried
  // across the iteration (the row inside the page is recomputed at the load: fewer registers).
  // Rows past `hi` use the last valid row instead (no branch, no fault); their scores are masked
  // to -inf, so their probabilities are exactly 0.
  int kpage[TILES][2], vpage[TILES][4];
  auto k_row = [&](int base, int i) { return min(base + 8 * i + g, hi - 1); };
  auto v_row = [&](int base, int j) { return min(base + 2 * c + (j & 1) + 8 * (j >> 1), hi - 1); };
  auto lookup = [&](int base0) {
    int off;
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
      for (int i = 0; i < 2; ++i) kpage[tile][i] = int(fi_attn::page_of(p, page_lo, k_row(base0 + 16 * tile, i), off));
#pragma unroll
      for (int j = 0; j < 4; ++j) vpage[tile][j] = int(fi_attn::page_of(p, page_lo, v_row(base0 + 16 * tile, j), off));
    }
  };
  if (AHEAD && lo + warp * 16 * TILES < hi) lookup(lo + warp * 16 * TILES);
#endif
  // 16-token tiles per warp iteration. Loads of all tiles are issued before any is used: a warp
  // has KD*2 + VD*4 cache elements per tile in flight; fp8 halves those bytes, so it takes two
  // tiles to keep ~8 KB per warp (~96 KB per SM at 3 CTAs) in flight, which HBM3e needs.
  for (int base0 = lo + warp * 16 * TILES; base0 < hi; base0 += NW * 16 * TILES) {
    Raw<KBYTES> rk[TILES][2];
    Raw<VBYTES> rv[TILES][4];
#if FI_MMA_VARIANT == 3
    ring.next(p, base0, rk[0], rv[0]);
#else
    if (!AHEAD) lookup(base0);
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
      const int base = base0 + 16 * tile;
#pragma unroll
      for (int i = 0; i < 2; ++i)
        rk[tile][i].load(kb + int64_t(kpage[tile][i]) * p.k_sp + fi_attn::row_in_page(p, k_row(base, i)) * p.k_st,
                         4 * PE);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        rv[tile][j].load(vb + int64_t(vpage[tile][j]) * p.v_sp + fi_attn::row_in_page(p, v_row(base, j)) * p.v_st,
                         8 * VP);
    }
    // warp-uniform: the next iteration's base is the same for all lanes
    if (AHEAD && base0 + NW * 16 * TILES < hi) lookup(base0 + NW * 16 * TILES);
#endif
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
      const int base = base0 + 16 * tile;
      float s[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
        uint32_t kw[KD / 2];
        to_pairs<KD>(rk[tile][i], kw);
#pragma unroll
        for (int st = 0; st < KSTEPS; ++st) mma(s[i], qa[st][0], 0u, qa[st][1], 0u, kw[2 * st], kw[2 * st + 1]);
      }
      // Scores of row g: s[i][e] is token base + 8i + 2c + e.
      float x[4];
      float mx = m;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = base + 8 * i + 2 * c + e;
          float v = s[i][e] * p.q_mul;
          if constexpr (SOFTCAP) v = p.cap_mul * tanhf(v);
          if constexpr (POS == 2) v += slope * float(t - qpos);
          v = t < hi ? v : fi::kNegInf;
          x[2 * i + e] = v;
          mx = fmaxf(mx, v);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(fi::kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(fi::kFullMask, mx, 2));
      // token base0 < hi is visible (tile 0), so mx is finite; a later tile wholly past hi keeps
      // mx = m, corr = 1 and p = 0
      const float corr = fi::exp2_approx(m - mx);
      m = mx;
      float pr[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) pr[k] = fi::exp2_approx(x[k] - mx);
      l = l * corr + (pr[0] + pr[1]) + (pr[2] + pr[3]);
      // Columns 2c, 2c+1 of O^T are heads 2c, 2c+1: their corrections live in S rows 2c, 2c+1.
      // Skipping this rescale in tiles where no running max grew (a warp vote), or keeping a
      // stale max until it grows by 2^8, measured no faster on fp8 (1.046 / 1.052 against 1.053
      // relative to the old ring, decode_ab_fp8_lazy_session9.json).
      const float corr0 = __shfl_sync(fi::kFullMask, corr, 8 * c);
      const float corr1 = __shfl_sync(fi::kFullMask, corr, 8 * c + 4);
#pragma unroll
      for (int i = 0; i < MTILES; ++i) {
        o[i][0] *= corr0;
        o[i][1] *= corr1;
        o[i][2] *= corr0;
        o[i][3] *= corr1;
      }
      const uint32_t pb0 = pack(pr[0], pr[1]);  // P^T[tokens 2c, 2c+1][head g]
      const uint32_t pb1 = pack(pr[2], pr[3]);  // P^T[tokens 8+2c, 9+2c][head g]
      uint32_t vw[4][VD / 2];
#pragma unroll
      for (int j = 0; j < 4; ++j) to_pairs<VD>(rv[tile][j], vw[j]);
#pragma unroll
      for (int i = 0; i < MTILES; ++i) {
        // element 2i (row g) in the low halves, 2i + 1 (row g + 8) in the high halves
        const uint32_t a0 = __byte_perm(vw[0][i], vw[1][i], 0x5410u);
        const uint32_t a1 = __byte_perm(vw[0][i], vw[1][i], 0x7632u);
        const uint32_t a2 = __byte_perm(vw[2][i], vw[3][i], 0x5410u);
        const uint32_t a3 = __byte_perm(vw[2][i], vw[3][i], 0x7632u);
        mma(o[i], a0, a1, a2, a3, pb0, pb1);
      }
    }
  }
  fi::launch_dependents();  // no more K/V to stream: the next grid may start launching
  trace(2);
  l += __shfl_xor_sync(fi::kFullMask, l, 1);
  l += __shfl_xor_sync(fi::kFullMask, l, 2);

  // Merge the NW warp states through shared memory.
#if FI_MMA_VARIANT == 3
  // The arrays overlay the ring: only empty groups can still be pending (every copied stage was
  // waited for), and the barrier makes sure no warp still reads its ring.
  fi::cp_async_wait<0>();
  __syncthreads();
  MergeSmem& ms = *reinterpret_cast<MergeSmem*>(ring_smem);
  auto& sm_o = ms.o;
  auto& sm_m = ms.m;
  auto& sm_l = ms.l;
#else
  __shared__ __align__(16) float sm_o[NW][GH][D];
  __shared__ float sm_m[NW][GH], sm_l[NW][GH];
#endif
#pragma unroll
  for (int i = 0; i < MTILES; ++i) {
    const int d = v_dim(g, 2 * i);  // rows g, g + 8 of m-tile i: local V elements 2i, 2i + 1
    if (2 * c < GH) { sm_o[warp][2 * c][d] = o[i][0]; sm_o[warp][2 * c][d + 1] = o[i][2]; }
    if (2 * c + 1 < GH) { sm_o[warp][2 * c + 1][d] = o[i][1]; sm_o[warp][2 * c + 1][d + 1] = o[i][3]; }
  }
  if (g < GH && c == 0) { sm_m[warp][g] = m; sm_l[warp][g] = l; }
  __syncthreads();
  fi_attn::store_merged<QT, D, GH, NW, NW * 32>(p, sm_o, sm_m, sm_l, req, qh0, part);
  trace(3);
}

__global__ void __launch_bounds__(NW * 32, CTAS_PER_SM) decode_mma_kernel(const Params p) {
  trace(0);
  fi_attn::DecodeWork wk;
  fi_attn::Spread sp;
  if (!fi_attn::decode_work<GH>(p, wk, sp)) {  // CUDA-graph mode launches the capacity
    trace(3);
    return;
  }
  do attend(p, wk);
  while (FI_DECODE_SPREAD_MODE &&
         (fi_attn::next_piece<GH>(p, wk) || (sp.sweeper && fi_attn::next_work<GH>(p, wk, sp))));
}

}  // namespace

FI_EXPORT int fi_batch_decode(const DecodeArgs* a) {
  constexpr int64_t kMax32 = (int64_t(1) << 31) - 1;  // row_off's 32-bit strides (Python checks too)
  if (a->k_stride_page > kMax32 || a->k_stride_tok > kMax32 || a->v_stride_page > kMax32 ||
      a->v_stride_tok > kMax32)
    return int(cudaErrorInvalidValue);
  const Params p = fi_attn::make_params<QT, KVT>(a, SOFTCAP, GH);
  return fi_attn::launch_batch_decode<QT, D>(a, p, decode_mma_kernel, NW * 32, SMEM_BYTES);
}

#if FI_DECODE_TRACE
FI_EXPORT int fi_decode_trace_read(void* dst) {
  return int(cudaMemcpyFromSymbol(dst, fi_decode_trace, sizeof(fi_decode_trace)));
}
#endif

FI_EXPORT int fi_batch_decode_occupancy(int* blocks_per_sm) {
  return fi_attn::batch_decode_occupancy(blocks_per_sm, decode_mma_kernel, NW * 32, SMEM_BYTES);
}
