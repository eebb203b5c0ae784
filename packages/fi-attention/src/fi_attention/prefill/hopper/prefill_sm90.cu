// FlashAttention-3-style prefill attention for Hopper (sm_90a), ragged Q/K/V in NHD layout.
//
// One CTA = one 128-row query tile of one head of one request; 3 warpgroups:
//   WG0      producer: one thread issues TMA loads (Q once, then K/V tiles into a 3-stage ring
//            (2 at d=256), walking the KV tiles from the last to the first so the masked tiles
//            come first); paged K/V: one thread per warp, each issuing a share of the pages. K
//            and V stages have their own "empty" barriers (see SharedStorage).
//   WG1, WG2 consumers: each owns 64 query rows. S = Q K^T with wgmma RS at d = 64, 128 (Q copied
//            into registers once per tile, see kQInRegs) or SS (d = 256: both from smem), P = softmax
//            in fp32 registers, O += P V with wgmma RS (P converted to 16-bit in registers, V read
//            transposed from smem through an MN-major descriptor).
// Intra-warpgroup overlap: the Q K^T of tile n-1 is issued before the P V of tile n, so the softmax
// of tile n-1 runs on the CUDA cores while the tensor cores do P V (FA3 paper, section 3.2); the
// two consumer warpgroups issue independently (no ping-pong, see kPingPong). Across work tiles
// (persistent CTAs, d = 64 / 128): a tile's last P V is issued with the next tile's first Q K^T
// (kCrossTile).
// Long launches at d = 128 with an even GQA group (FI_FA3_MULTICAST, auto by default): 2-CTA
// clusters share every K/V tile by TMA multicast (kMcast).
// setmaxnreg moves registers from the producer (24-32) to the consumers (which hold a 64xd fp32 O
// tile, a 64xkBlockN fp32 S tile and a 16-bit P tile per warpgroup); see kProducerRegs.
// Measured on the H200 and not kept (tools/ab_fa3.py in turns, benchmarks/notes.md session 15):
// tiles of 32 tokens x the 4 query heads of a KV head (ragged x0.95), tiles walked by groups of
// requests for L2 reuse (hit rate 65 -> 86 %, same time: the batch cases are not memory-bound).
// Session 18 (prefill_fa3_ab_session18_*.json): 1/8 to 1/2 of the softmax's exponentials on the FMA
// pipe (a degree-3 polynomial) x0.87-0.99, 24/240 registers for the ragged kernel x0.994-1.000,
// the row sums from a 64x8 wgmma of P and a matrix of ones x0.895-0.987.
//
// Build defines (one instantiation per module): FI_DTYPE_BF16 (1 = bf16, 0 = fp16), FI_HEAD_DIM
// (64, 128, 256), FI_CAUSAL (0/1), FI_PAGED (0: ragged K/V, 1: page table), FI_SOFTCAP (0/1:
// logits = cap * tanh(sm_scale * q.k / cap)), FI_CUSTOM_MASK (0/1: packed boolean masks, see
// kCustomMask), FI_FA3_MCAST (0/1, d = 128: K/V multicast, see kMcast), FI_KV_FP8 (0: K/V in the
// Q dtype; 1 / 2: fp8 e4m3 / e5m2 K/V widened in shared memory, see kKV8).
// Built with -DNDEBUG so wgmma is not serialised (ptxas C7510).
#include <cuda.h>  // CUtensorMap and enums only: the driver entry point comes from the runtime
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

// wgmma shapes whose N is not a multiple of 32 are declared by CuTe only on request. d = 256 needs
// them: without, its 80-column Q K^T became five 64x16 wgmma per k-slab instead of one 64x80
// (tools/ab_fa3.py single4k_d256, H200: 700.8 -> 453.3 us, 392 -> 606 TFLOP/s).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/numeric_types.h>

#include "fi/common.cuh"
#include "fi/fp8_widen.cuh"
#include "fi/mask_bits.cuh"
#include "fi/math.cuh"

#ifndef FI_HEAD_DIM
#define FI_HEAD_DIM 128
#endif
#ifndef FI_CAUSAL
#define FI_CAUSAL 0
#endif
#ifndef FI_DTYPE_BF16
#define FI_DTYPE_BF16 1
#endif
#ifndef FI_PAGED
#define FI_PAGED 0
#endif
#ifndef FI_SOFTCAP
#define FI_SOFTCAP 0
#endif
#ifndef FI_CUSTOM_MASK
#define FI_CUSTOM_MASK 0
#endif
#ifndef FI_KV_FP8
#define FI_KV_FP8 0
#endif
// FI_FA3_VARIANT selects an experimental schedule for A/B runs (bench option variant=N); 0, the
// default, is the shipped one.
#ifndef FI_FA3_VARIANT
#define FI_FA3_VARIANT 0
#endif

namespace fi_hopper {
using namespace cute;

#if FI_DTYPE_BF16
using Element = cutlass::bfloat16_t;
#else
using Element = cutlass::half_t;
#endif

constexpr int kHeadDim = FI_HEAD_DIM;
constexpr bool kCausal = FI_CAUSAL != 0;
constexpr bool kPaged = FI_PAGED != 0;
constexpr bool kSoftcap = FI_SOFTCAP != 0;
// Custom masks (packed bits per request, FlashInfer's packbits order): every KV tile is masked.
// Each consumer thread reads its two rows' bits for the next KV tile as aligned 32-bit words
// (fi::mask_windows32: 5 loads and 4 funnel shifts per row and 128 keys, where the byte form took
// up to 20 byte loads) before it waits for that tile's Q K^T, and folds the row's key range in only
// on tiles that need it. tools/ab_fa3.py in turns against session 31's byte windows read after the
// wait (random mask of density 1/2, L = 4096, 9 rounds, prefill_fa3_ab_session32_mask_loads.json):
// x1.59 / x1.82 / x1.66 at d = 64 / 128 / 256 (loads before the wait alone: x0.97 / 1.14 / 1.14).
constexpr bool kCustomMask = FI_CUSTOM_MASK != 0;
constexpr int kBlockM = 128;                           // 2 consumer warpgroups x 64 rows
constexpr int kBlockN = kHeadDim <= 128 ? 128 : 80;    // d=256: 80 keeps Q + 2x(K,V) in 227 KB
// K/V ring depth. d <= 128: 3 stages (Q 32 KB + 3 x (K, V) 32 KB = 224 KB of the 227 KB) so a
// TMA load (~1 us from L2/HBM, about one KV iteration of both warpgroups) is issued >= 2
// iterations before its tile is consumed; d = 256 only fits 2.
// Measured and not kept (session 8, tools/ab_fa3.py, prefill_fa3_ab_session8_two_q.json): two Q
// buffers (the next tile's Q loads as soon as the producer has issued the current tile's K/V) at
// the cost of the third stage: x0.998 / 0.995 / 0.986 on single 2k / 4k / 16k, x0.994 on the ragged
// batch, x0.923 on the paged one.
// fp8 K/V (FI_KV_FP8 = 1 e4m3, 2 e5m2; d = 64 and 128): wgmma takes no fp8 operand beside a 16-bit
// one, so the tiles are widened to the Q dtype in shared memory, in place: TMA lands each raw fp8
// K/V tile (half the bytes of a 16-bit one, unswizzled rows of kHeadDim bytes) in the upper half of
// the 16-bit stage it is widened into, as soon as the consumers release that stage (the same ring
// of 3 stages and the same lead as 16-bit caches); producer warp 0 issues the loads, warps 1-3
// widen each tile as it lands (see widen_tile for why in place is safe). The consumers are
// unchanged. Widening is exact for every finite value (each e4m3 / e5m2 value is a bf16 and an
// fp16 value, see fi/fp8_widen.cuh); k_scale stays with the caller (in sm_scale), v_scale is out_scale.
// Measured (session 47, H100, paged 16 x 2048 page 16 causal 32/8 d128 over an e4m3 cache, in
// turns): 1599-1620 us against fa2's 2357-2411 (x1.48) and fa3 over bf16's 1111-1148; without the
// widening's loads, conversion and stores (A/B bit 8192, wrong results) 1060-1066.
constexpr bool kKV8 = FI_KV_FP8 != 0;
static_assert(!kKV8 || kHeadDim <= 128, "fp8 K/V: head_dim 64 or 128");
constexpr int kStages = kHeadDim <= 128 ? 3 : 2;
// kKV8: the bytes of one raw fp8 K (or V) tile, which is also where it lands in its 16-bit stage
// (the upper half).
constexpr int kRawBytes = kBlockN * kHeadDim;
constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;
constexpr int kBoxCols = 64;                           // 64 x 16-bit = one 128-byte swizzle row
constexpr int kBoxes = kHeadDim / kBoxCols;
static_assert(kHeadDim % kBoxCols == 0, "head_dim must be a multiple of 64");
// Register budget per warpgroup after setmaxnreg. setmaxnreg moves registers inside the CTA's own
// pool (PTX ISA: setmaxnreg.inc blocks until the CTA pool has them), which holds only the launch
// allocation: __launch_bounds__(kThreads, 1) gives 65536 / kThreads rounded down to 8 = 168 per
// thread (ptxas reports 168 for every variant), 168 x 384 = 504 x 128 in all. A budget above it
// (32/240 = 512 x 128) leaves a consumer warpgroup in setmaxnreg.inc forever: the round-2 kernel
// hung on the H200 that way. Budgets with 0 spills on sm_90a (nvcc 13.0):
//   d = 128:  40/232 (64512 exactly). The persistent producer's tile loop (tile decode, the page
//             ids of its boxes, pipeline counters) spills at 32 in the paged kernel; the
//             consumers' peak (64x128 S and O) fits in 232.
//   d = 64:   56/216. The same producer spills even at 40 here; the consumers need far less.
//   d = 256:  24/240. The consumers hold a 64x256 fp32 O (128 registers) and spill below 240; the
//             one-tile-per-CTA producer fits in 24. 24*128 + 240*256 = 64512 exactly: the consumers
//             read the per-tile scalars from shared memory (TileDesc) at each use to fit.
constexpr int kProducerRegs = kHeadDim == 64 ? 56 : kHeadDim == 128 ? 40 : 24;
constexpr int kConsumerRegs = kHeadDim == 64 ? 216 : kHeadDim == 128 ? 232 : 240;
constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;  // per thread, from __launch_bounds__
constexpr int kPoolRegs = kLaunchRegs * kThreads;          // the CTA's pool
static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= kPoolRegs,
              "setmaxnreg budget exceeds the CTA's register allocation (setmaxnreg.inc would block forever)");
static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256 &&
                  kProducerRegs <= kLaunchRegs && kConsumerRegs >= kLaunchRegs,
              "setmaxnreg takes multiples of 8 in [24, 256]; dec must lower and inc raise the launch count");
// Ping-pong (FA3 "warp scheduler barrier"): the two consumer warpgroups take turns issuing their
// GEMMs, so one warpgroup's softmax overlaps the other's GEMMs. Off: once each warpgroup's softmax
// runs under its own P V (see the KV loop), the turn-taking only added waits. tools/ab_fa3.py,
// paired medians of 9 rounds (H200, 2026-11-30), without against with: L=8192 causal +1.7 % (9 of
// 9 rounds), L=4096 without mask +1.4 %, ragged 16 x 2048 +1.5 %, paged +4.2 %, L=16384 -0.2 %.
// FI_FA3_VARIANT bit 2 turns it back on for A/B runs. Barrier ids kSchedBarrier + wg - 1.
constexpr bool kPingPong = kHeadDim <= 128 && (FI_FA3_VARIANT & 2);
constexpr int kSchedBarrier = 1;
// Persistent CTAs (see tile_of) for d <= 128. d = 256 keeps one tile per CTA: its consumers hold a
// 64x256 fp32 O at the 240-register limit, and the tile loop's extra live state spills there.
constexpr bool kPersistent = kHeadDim <= 128;
// FI_FA3_MCAST = 1 (d = 128 modules for an even GQA group; FI_FA3_MULTICAST=auto, the default,
// takes them for launches of >= 1e12 FLOPs of attention, spec.MULTICAST_MIN_FLOPS; =1 always, =0
// never): K/V shared by TMA multicast. CTAs launch as 2-CTA clusters whose two CTAs take the
// tiles of query heads 2h and 2h + 1 (one KV head, same request and m-block: the same KV tiles);
// each loads one of the two 64-column boxes of every K and V tile into the shared memory of both,
// halving the L2-to-SM bytes per FLOP. A stage is refilled only once both CTAs' consumers released
// it: its empty barrier counts this CTA's 256 consumer threads and one arrive per consumer warp of
// the other CTA. H200 (benchmarks/notes.md session 24): at the 700 W cap it buys clock, 4 s
// sustained L = 16384 at 1658 against 1578 MHz, 604 against 588 TFLOP/s, paged 16 x 2048 430
// against 423; below the cap it loses per clock (in turns x0.963-0.975 single and ragged, x1.005
// paged; bench routines single 4k 600 and paged 492 against session 23's 625 and 515), so short
// launches keep one CTA per tile; long ones (16k and up) gain 1-1.5 % in the bench. A runtime
// multicast switch in the KV loop had cost ~3 % more (x0.971 against x1.001 for this compile-time
// form), hence the separate module.
#ifndef FI_FA3_MCAST
#define FI_FA3_MCAST 0
#endif
constexpr bool kMcast = FI_FA3_MCAST != 0;
static_assert(!kMcast || kHeadDim == 128, "multicast splits the two 64-column boxes of d = 128 between the CTAs");
static_assert(!(kMcast && kKV8), "fp8 K/V modules do not multicast");

// ---- shared memory layouts (CuTe) --------------------------------------------------------------
// The 128B-swizzled K-major atom is 8 rows x 64 columns; TMA with SWIZZLE_128B and a 64-column box
// writes exactly this pattern, one box (all rows x 64 columns) after the other.
using SmemAtom = decltype(GMMA::Layout_K_SW128_Atom<Element>{});
using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
using SmemLayoutK =
    decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
// V^T view of the V tiles: (d, n, stage) -> V(n, d, stage); wgmma reads it as an MN-major B.
using SmemLayoutVt = decltype(composition(
    SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                               Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));

// d = 64 and 128: Q K^T is an RS wgmma with Q copied into registers (ldmatrix; 32 per consumer
// thread at d = 128) at the start of each tile, instead of SS re-reading Q from shared memory for
// every KV tile (at d = 128, 16 of the 80 KB of wgmma operand reads per warpgroup and KV tile); the
// Q buffer is released right after the copy, so the next tile's Q loads a whole tile ahead. The
// kernel is power-bound (the H200 holds its 700 W cap with the SM clock at ~1585 MHz,
// benchmarks/notes.md session 22): fewer shared-memory reads per FLOP is what can raise its rate.
// tools/ab_fa3.py in turns against SS (paired medians of 11 rounds): d = 128 single 16k x1.006,
// 4k x1.002, ragged 16 x 2048 x1.005, paged x1.015 (prefill_fa3_ab_session22_q_in_registers.json);
// d = 64 single 4k / 16k x1.006 / x1.006 (prefill_fa3_ab_session23_d64_q_in_registers.json).
// d = 256 keeps SS (its consumers sit at the 240-register limit). FI_FA3_VARIANT bit 64: SS at
// d = 64 and 128, for A/B runs.
constexpr bool kQInRegs = kHeadDim <= 128 && !(FI_FA3_VARIANT & 64);
// Cross-tile overlap (persistent d = 64 / 128 kernels with Q in registers): a tile's last P V is
// not waited for at its end but issued together with the next tile's first Q K^T, whose mask and
// row max then run on the CUDA cores under that P V (ptxas places the exponentials after the P V
// wait there), followed by the previous tile's epilogue. Q in registers is what makes this
// possible: the next tile's Q has landed a whole tile ahead (its buffer is released at the current
// tile's start); with one Q buffer released after the last Q K^T the same schedule had waited for
// Q (x0.85-0.97, sessions 6 and 15). The previous tile's descriptor is still read during the next
// tile's first block, after the consumers released the next tile's Q, so the descriptor ring holds
// three tiles. tools/ab_fa3.py against the source without it (H200, paired medians of 31 rounds,
// prefill_fa3_ab_session26_crosstile3.json): single 4k x1.009, 16k x1.011, ragged 16 x 2048
// x1.008, paged x1.003, paged with pages in order x1.004. Small: the kernels run at the board's
// power cap, where idle time saved partly turns into a lower clock. Not with the soft cap (its
// d = 128 consumers, which already spill 8 bytes, spilled 24 with it). FI_FA3_VARIANT bit 1024
// turns it off for A/B runs.
constexpr bool kCrossTile = kPersistent && kQInRegs && !kSoftcap && !(FI_FA3_VARIANT & 1024);
constexpr int kDescSlots = kCrossTile ? 3 : 2;
// kQKAhead (with kCrossTile): a tile's second Q K^T is issued before the previous tile's epilogue,
// which then runs on the CUDA cores while the tensor cores compute it; the KV loop is rotated for
// it (see the consumers). FI_FA3_VARIANT bit 16384 turns it off for A/B runs.
constexpr bool kQKAhead = kCrossTile && !(FI_FA3_VARIANT & 16384);
// kRotatedLoop: the consumers' KV loop issues each step's GEMMs at the end of the step before
// (needed for kQKAhead; also 2.5 % faster for the soft-cap modules, 2.6 % slower at d = 256).
constexpr bool kRotatedLoop = kHeadDim <= 128;
using QKShape = Shape<Int<kBlockM / 2>, Int<kBlockN>, Int<kHeadDim>>;
using TiledMmaQK = decltype(make_tiled_mma(
    std::conditional_t<kQInRegs, decltype(GMMA::rs_op_selector<Element, Element, float, QKShape>()),
                       decltype(GMMA::ss_op_selector<Element, Element, float, QKShape>())>{},
    Layout<Shape<_2, _1, _1>>{}));
using TiledMmaPV = decltype(make_tiled_mma(
    GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockM / 2>, Int<kHeadDim>, Int<kBlockN>>,
                         GMMA::Major::K, GMMA::Major::MN>(),
    Layout<Shape<_2, _1, _1>>{}));
// The RS A fragment of a 64x16 k-slab holds the same 8 values, in the same order, as the fp32
// accumulator of the 16 S columns it came from, so P reuses S's register order.
using LayoutP = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>>;

// What the consumers know of a work tile, written to shared memory by the producer thread that
// loads its Q (before the arrive on bar_q that the consumers wait on, which releases the writes).
// The consumers read no indptr or page table: decoding a tile from global memory (dependent L2
// round trips for indptrs and last_page_len) sat at the start and end of every tile on the
// consumers' critical path. Read with lds at each use (never held in registers through the KV
// loop: that made the d=256 consumers spill at 240). Slot q_it % kDescSlots: the producer writes
// tile q_it after the consumers' release of Q for tile q_it - 1. With two slots the slot's
// previous tile, q_it - 2, is finished by then; with kCrossTile the consumers release Q of tile
// q_it - 1 before the epilogue of tile q_it - 2, so a third slot keeps that tile's descriptor.
enum TileDescField {
  kDescKind,     // kTileWork, kTileNoKeys (no row sees a key: O = 0, lse = -inf), kTileEnd
  kDescRowDiag,  // m_block * kBlockM + kv_len - qo_len: tile row r sees keys j <= r + row_diag
  kDescKvLen,
  kDescNStart,   // KV tiles [n_start, n_end), walked from the last
  kDescNEnd,
  kDescQRow,     // token index of the tile's first query row (qo_start + m_block * kBlockM)
  kDescRows,     // query rows of the tile (<= kBlockM)
  kDescHead,
#if FI_CUSTOM_MASK
  kDescMaskByte,  // the request's first mask byte (mask_indptr[b])
  kDescMaskLen,   // its mask bytes, ceil(qo_len * kv_len / 8): aligned word loads stay inside them
  kDescMRow,      // m_block * kBlockM: the tile's first query row within its request
#endif
  kDescInts
};
enum TileKind { kTileWork = 0, kTileNoKeys = 1, kTileEnd = 2 };

struct alignas(1024) SharedStorage {
  Element q[kBlockM * kHeadDim];                 // every box starts on a 1024-byte swizzle period
  Element k[kStages * kBlockN * kHeadDim];
  Element v[kStages * kBlockN * kHeadDim];
  uint64_t bar_q;    // Q of the current tile landed
  uint64_t empty_q;  // consumers are done with the current Q (copied to registers, or the tile's
                     // last Q K^T issued and complete): the next Q may load
  uint64_t full_k[kStages];
  uint64_t full_v[kStages];
  // K and V stages are released separately: K(n) is free as soon as S(n) = Q K(n)^T completes
  // (mid-iteration), V(n) only after O += P(n) V(n); one shared barrier would hold K a whole
  // extra half iteration and serialise the next K load behind the P V GEMM.
  uint64_t empty_k[kStages];
  uint64_t empty_v[kStages];
  // The consumers' work tiles, published by the producer (see TileDesc): slot q_it % kDescSlots
  // holds the q_it-th tile of this CTA.
  int tiles[kDescSlots][kDescInts];
  // fp8 K/V (kKV8; last, so the 16-bit modules keep their layout): a stage's raw tile has landed
  // (TMA bytes); full_k / full_v then count the kWideners widening threads.
  uint64_t raw_full_k[kStages];
  uint64_t raw_full_v[kStages];
};
static_assert(sizeof(SharedStorage) + 1024 <= 227 * 1024, "shared memory over the sm_90 limit");
constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + room to align the base

struct Params {
  CUtensorMap tma_q;  // dims (d, head, token); box (64, 1, kBlockM)
  CUtensorMap tma_k;  // ragged: box (64, 1, kBlockN); paged: dims (d, head, token, page),
  CUtensorMap tma_v;  //   box (64, 1, min(page_size, kBlockN), 1)
  Element* o;
  float* lse;
  const int* qo_indptr;
  const int* kv_indptr;
  int64_t o_tok, o_head;
  int num_qo_heads, group_size, num_m_blocks, batch;
  int single_qo_len, single_kv_len;  // used when qo_indptr is NULL
  int window_left;                    // -1: no sliding window
  // Paged K/V: kv_indptr indexes kv_indices (pages); a request's keys are its pages in order,
  // the last one holding last_page_len tokens.
  const int* kv_indices;
  const int* last_page_len;
  int page_size;
  int q_heads_outer, kv_heads_outer;  // ragged/Q maps: 1 = dims (d, token, head) (head stride > token)
  int heads_outer;  // 1: map dims (d, token, head, page) (HND caches); 0: (d, head, token, page)
  float scale_log2;  // sm_scale * log2(e): softmax in base 2 (soft cap: cap * log2(e))
  float softcap_pre; // soft cap: sm_scale / cap, applied before tanh
  float out_scale;   // multiplies O in the epilogue (the caller's v_scale; 1: none)
  const uint8_t* mask;     // custom mask modules: packed bits, request b's from byte mask_indptr[b]
  const int* mask_indptr;  // NULL: one request (single prefill), its bits from byte 0
};

// ---- PTX helpers: mbarrier, TMA, register reconfiguration --------------------------------------
FI_DEVICE uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

FI_DEVICE void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
FI_DEVICE void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
FI_DEVICE void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Blocks until the phase with parity `phase` has completed (a fresh barrier counts parity 1 done).
FI_DEVICE void mbar_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}" ::"r"(smem_u32(bar)),
      "r"(phase)
      : "memory");
}
FI_DEVICE void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
FI_DEVICE void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2);
// Rows `token..` of one head; heads_outer maps (HND-strided tensors) have dims (d, token, head).
FI_DEVICE void tma_load_rows(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int head, int token,
                             int heads_outer) {
  tma_load_3d(dst, map, bar, col, heads_outer ? token : head, heads_outer ? head : token);
}
FI_DEVICE void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// Multicast forms (kMcast): the box lands at the same offset in every CTA of `mask` and completes
// bytes on the barrier at the same offset in each.
FI_DEVICE void tma_load_4d_mc(void* dst, const CUtensorMap* map, uint64_t* bar, uint16_t mask, int c0, int c1, int c2,
                              int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4, %5, %6, %7}], [%2], %3;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "h"(mask), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
FI_DEVICE void tma_load_3d_mc(void* dst, const CUtensorMap* map, uint64_t* bar, uint16_t mask, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4, %5, %6}], [%2], %3;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "h"(mask), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
FI_DEVICE uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of both CTAs (warp-converged): barrier inits before, remote accesses after.
FI_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Arrive on the barrier at `bar`'s offset in CTA `rank` of the cluster.
FI_DEVICE void mbar_arrive_cta(uint64_t* bar, uint32_t rank) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_u32(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(a) : "memory");
}
// Shared-memory access the compiler keeps in program order and never hoists or caches in a
// register across uses (volatile asm): see TileDesc.
FI_DEVICE int lds(const int* ptr) {
  int v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(smem_u32(ptr)));
  return v;
}
FI_DEVICE void sts(int* ptr, int v) { asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(ptr)), "r"(v)); }
// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads (wgmma
// operands) that a barrier arrive publishes.
FI_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Named barriers (id 0 is __syncthreads): ping-pong between the two consumer warpgroups.
FI_DEVICE void named_sync(int id, int threads) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory"); }
FI_DEVICE void named_arrive(int id, int threads) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory"); }
template <int N> FI_DEVICE void reg_alloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N> FI_DEVICE void reg_dealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }

// Issue one warpgroup GEMM C (+)= A B over all k-slabs and commit it as one wgmma group; the caller
// waits (warpgroup_wait) before touching C, and before overwriting a register A.
// kRegA: A is a register fragment (RS); otherwise A is an smem descriptor (SS).
template <bool kZeroInit, bool kRegA, class Mma, class TA, class TB, class TC>
FI_DEVICE void gemm_issue(Mma& mma, TA& a, TB const& b, TC& c) {
  if constexpr (kRegA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegA) warpgroup_fence_operand(a);
}

FI_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
FI_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

FI_DEVICE uint32_t pack2(float a, float b) {
#if FI_DTYPE_BF16
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
#else
  __half2 h = __floats2half2_rn(a, b);
#endif
  return *reinterpret_cast<uint32_t*>(&h);
}

FI_DEVICE uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
FI_DEVICE void sts128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}
// Global stores under a predicate, with no branch. The epilogue runs between a wgmma issue and
// its wait (kQKAhead); with its stores branched over, ptxas kept the KV counter, and with it every
// wgmma descriptor of the consumers, in vector registers (an R2UR before each HGMMA).
FI_DEVICE void stg128_if(bool pred, void* ptr, uint4 v) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.global.v4.b32 [%1], {%2, %3, %4, %5};\n}"
               ::"r"(int(pred)), "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
FI_DEVICE void stg32_if(bool pred, float* ptr, float v) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.global.f32 [%1], %2;\n}"
               ::"r"(int(pred)), "l"(ptr), "f"(v)
               : "memory");
}
// Eight fp8 values (two words) widened exactly to the Q dtype: one 16-byte chunk of 16-bit
// elements (fi/fp8_widen.cuh: four instructions per bf16 pair, no conversion unit).
FI_DEVICE uint4 widen8(uint32_t a, uint32_t b) {
#if FI_FA3_VARIANT & 4096
  return make_uint4(a, a >> 16, b, b >> 16);  // A/B timing only (wrong results): no conversion
#endif
  return fi::widen_fp8x8<FI_DTYPE_BF16 != 0, FI_KV_FP8 == 2>(a, b);
}

// Widen one fp8 tile in place: its raw rows (kHeadDim bytes each, unswizzled, as TMA lands them at
// byte kRawBytes of the stage) become the 16-bit tile in the 128B-swizzled layout the wgmma
// descriptors read (kBoxes boxes of kBlockN rows x 64 columns; 16-byte chunk j of row r at
// j ^ (r % 8)). `stage` is a shared-memory address; t is the widening thread (of kWideners). Each
// thread keeps one raw 16-byte column chunk and steps down the rows kRowStep (12 at d = 128, 24 at
// d = 64) at a time, so its column, box and store order are fixed and only the row advances.
// d = 128: raw row r occupies exactly the 128 bytes that widened row r of box 1 will, and box 0
// lies below the raw half, so a round's stores overwrite only the raw rows loaded for that round.
// A warp holds 4 whole rows per round (no two warps share a row) and syncs between its loads and
// stores of a round. (Loading the next round's rows before the current round's conversion was
// slower: x0.85 in turns, session 47, with 20 more bytes of producer spills.) Within each quarter
// warp the lanes of box 0 take row r and those of box 1 row r ^ 1: their swizzle phases differ in
// bit 0, so the two boxes' stores fall in opposite bank halves, and the loads read halves of two
// adjacent raw rows (64 + 64 bytes): no bank conflicts, and no data selects. The swizzle phase
// alternates between two values over rounds 12 rows apart: both address pairs are set up once.
// d = 64 (one box): widened rows 0-63 lie below the raw half; rows 64-127 overwrite all raw rows,
// so every thread loads its chunks of raw rows 64-127 first, streams rows 0-63, and stores rows
// 64-127 after a barrier of the widening threads.
constexpr int kWideners = 96;      // producer warps 1-3 (kKV8); warp 0 issues the loads
constexpr int kWidenBarrier = 5;   // named barrier of the widening threads (d = 64)
FI_DEVICE void widen_tile(uint32_t stage, int t) {
#if FI_FA3_VARIANT & 8192
  return;  // A/B timing only (wrong results): the pipeline without the widening's loads and stores
#endif
  constexpr int kRowChunks = kHeadDim / 16;  // raw 16-byte chunks per row
  constexpr int kRowStep = kWideners / kRowChunks;
  // Only fp8 modules (head_dim 64 / 128) call it; the d = 256 modules compile it too (it is not a
  // template), so the layout rule holds only where it is used.
  static_assert(!kKV8 || (kWideners % kRowChunks == 0 && kRowStep % 4 == 0),
                "a fixed column and whole rows per warp");
  if constexpr (kHeadDim == 128) {
    const int q = t % 8, quarter = t / 8;  // column chunk (box 0 for q < 4), quarter warp
    const int r0 = (quarter & ~1) + ((quarter & 1) ^ (q >= 4 ? 1 : 0));  // rows 2m, 2m + 1 per quarter pair
    const int ch = (2 * q) % 8;  // output chunks ch, ch + 1 of box q / 4
    const uint32_t row_base = stage + ((q / 4) * kBlockN + r0) * 128;
    const uint32_t raw0 = stage + kRawBytes + r0 * kHeadDim + q * 16;
    uint32_t first[2], second[2];  // the two output chunks' addresses, per swizzle phase
    CUTE_UNROLL
    for (int e = 0; e < 2; ++e) {
      const int sw = (r0 + e * kRowStep) & 7;
      first[e] = row_base + e * kRowStep * 128 + ((ch ^ sw) * 16);
      second[e] = row_base + e * kRowStep * 128 + (((ch + 1) ^ sw) * 16);
    }
#pragma unroll 2
    for (int k = 0; k * kRowStep < kBlockN; ++k) {  // a fixed trip count keeps k & 1 static
      if (r0 + k * kRowStep < kBlockN) {  // whole warps: a warp's rows are 4 consecutive ones
        const uint32_t step = (k / 2) * (2 * kRowStep * 128);
        const uint4 v = lds128(raw0 + k * kRowStep * kHeadDim);
        __syncwarp();  // every lane of this warp has read this round's raw rows before any overwrites them
        sts128(first[k & 1] + step, widen8(v.x, v.y));
        sts128(second[k & 1] + step, widen8(v.z, v.w));
      }
    }
  } else {
    const int c = t % kRowChunks, row0 = t / kRowChunks;
    const int chunk = 2 * c;  // output chunks 2c, 2c + 1 (8 columns each)
    const uint32_t raw = stage + kRawBytes + t * 16;
    auto store = [&](int row, const uint4& v) {
      const uint32_t row_addr = stage + row * 128;
      const int sw = row & 7;
      sts128(row_addr + ((chunk ^ sw) * 16), widen8(v.x, v.y));
      sts128(row_addr + (((chunk + 1) ^ sw) * 16), widen8(v.z, v.w));
    };
    constexpr int kHalf = kBlockN / 2, kRounds = (kHalf + kRowStep - 1) / kRowStep;
    constexpr uint32_t kHalfBytes = kHalf * kRowChunks * 16;
    uint4 hi[kRounds];
    CUTE_UNROLL
    for (int k = 0; k < kRounds; ++k)
      if (row0 + k * kRowStep < kHalf) hi[k] = lds128(raw + kHalfBytes + k * kWideners * 16);
    CUTE_UNROLL
    for (int k = 0; k < kRounds; ++k) {
      const int row = row0 + k * kRowStep;
      if (row < kHalf) store(row, lds128(raw + k * kWideners * 16));
    }
    named_sync(kWidenBarrier, kWideners);
    CUTE_UNROLL
    for (int k = 0; k < kRounds; ++k) {
      const int row = row0 + k * kRowStep;
      if (row < kHalf) store(kHalf + row, hi[k]);
    }
  }
}

// Accumulator value v of a thread sits in row half (v >> 1) & 1 of its two rows (CuTe's SM90
// C layout: v = col_pair + 2 * row_half + 4 * col_block_of_8).
FI_DEVICE constexpr int row_of(int v) { return (v >> 1) & 1; }

// One work tile: a 128-row query block of one head of one request, and its KV tile range.
struct Tile {
  int m_block, head, b, qo_start, qo_len, kv_start, kv_len, diag, n_start, n_end;
  int mask_byte;  // custom masks: the request's first mask byte
  int mask_len;   // and its byte count (capped at INT_MAX: a shorter range only takes the byte path more)
  bool valid;  // false: the m-block is past this request's queries (nothing to do)
};

// Tile t in longest-first order: m-block slowest (descending), then request, then head (fastest,
// so the query heads of one KV head (GQA) run together and share K/V tiles in L2). Under causal
// masking the last query blocks see the most keys; handing them out first keeps the tail short.
FI_DEVICE Tile tile_info(const Params& p, int t) {
  Tile w;
  const int per_m = p.batch * p.num_qo_heads;
  w.m_block = p.num_m_blocks - 1 - t / per_m;
  w.b = (t % per_m) / p.num_qo_heads;
  w.head = t % p.num_qo_heads;
  // Single prefill passes no indptrs: one request of single_qo_len x single_kv_len.
  const bool single = p.qo_indptr == nullptr;
  w.qo_start = single ? 0 : p.qo_indptr[w.b];
  w.qo_len = single ? p.single_qo_len : p.qo_indptr[w.b + 1] - w.qo_start;
#if FI_PAGED
  w.kv_start = p.kv_indptr[w.b];  // first page of the request in kv_indices
  const int num_pages = p.kv_indptr[w.b + 1] - w.kv_start;
  const int last = p.last_page_len[w.b];  // loaded with the indptrs, not after them
  w.kv_len = num_pages > 0 ? (num_pages - 1) * p.page_size + last : 0;
#else
  w.kv_start = single ? 0 : p.kv_indptr[w.b];
  w.kv_len = single ? p.single_kv_len : p.kv_indptr[w.b + 1] - w.kv_start;
#endif
  w.valid = w.m_block * kBlockM < w.qo_len;
  w.mask_byte = kCustomMask && p.mask_indptr != nullptr ? p.mask_indptr[w.b] : 0;
  w.mask_len = kCustomMask ? int(min((int64_t(w.qo_len) * w.kv_len + 7) / 8, int64_t(INT_MAX))) : 0;
  // Query row i (0-based in its request) sees keys j <= i + diag (bottom-right aligned causal).
  w.diag = w.kv_len - w.qo_len;
  w.n_end = fi::ceil_div(w.kv_len, kBlockN);
  if (kCausal) {
    const int keys = min(w.kv_len, min((w.m_block + 1) * kBlockM, w.qo_len) + w.diag);
    w.n_end = keys <= 0 ? 0 : min(w.n_end, fi::ceil_div(keys, kBlockN));
  }
  // Sliding window: row i also needs j >= i + diag - window_left; the tile's first row bounds it.
  w.n_start = 0;
  if (p.window_left >= 0) w.n_start = max(0, w.m_block * kBlockM + w.diag - p.window_left) / kBlockN;
  return w;
}

// Persistent CTAs: CTA c takes tiles c, then 2G-1-c, then 2G+c, ... (G = gridDim.x): a snake over
// the longest-first order, so a CTA that got a longer tile in one round gets a shorter one in the
// next. The producer walks the sequence and hands each tile to the consumers (TileDesc), so their
// running pipeline counters (stage, phase) stay in lockstep across tiles; the next tile's Q and
// first K load while the consumers finish the current tile (no per-CTA launch/prologue bubble).
// With gridDim.x == number of tiles every CTA does exactly one tile (the non-persistent launch).
FI_DEVICE int tile_of(int round, int cta, int grid) {
  return round * grid + ((round & 1) ? grid - 1 - cta : cta);
}

__global__ void __launch_bounds__(kThreads, 1) prefill_sm90_kernel(const __grid_constant__ Params p) {
  extern __shared__ char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int num_tiles = p.num_m_blocks * p.batch * p.num_qo_heads;
  const int cta = blockIdx.x, grid = gridDim.x;
  constexpr bool mc = kMcast;
  // Arrivals that release a K or V stage (see release()).
  constexpr int kReleases = kConsumerThreads + (mc ? kConsumerThreads / 32 : 0);

  if (threadIdx.x == 0) {
    mbar_init(&ss.bar_q, 1);
    mbar_init(&ss.empty_q, kConsumerThreads);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&ss.full_k[s], kKV8 ? kWideners : 1);  // fp8: the widening threads, else the TMA bytes
      mbar_init(&ss.full_v[s], kKV8 ? kWideners : 1);
      mbar_init(&ss.empty_k[s], kReleases);
      mbar_init(&ss.empty_v[s], kReleases);
    }
    if constexpr (kKV8) {
      for (int s = 0; s < kStages; ++s) {
        mbar_init(&ss.raw_full_k[s], 1);
        mbar_init(&ss.raw_full_v[s], 1);
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (mc)
    cluster_sync();  // both CTAs' barriers exist before either multicasts into the other
  else
    __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ------------------------------------------------------------------ producer
    reg_dealloc<kProducerRegs>();
    constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
    constexpr uint32_t kKVBytes = kKV8 ? kRawBytes : kBlockN * kHeadDim * sizeof(Element);
    // Ragged: thread 0 issues everything. Paged, d <= 128: lane 0 of each of the 4 producer warps
    // issues the boxes j = warp, warp + 4, ... of every KV tile (a box is one page, or a slice of a
    // page larger than the tile). A TMA instruction takes its coordinates from uniform registers,
    // so a warp whose lanes hold different pages issues them one lane after the other: warp 0
    // issuing all 16 boxes of a page-16 tile (lane j box j, the form d = 256 keeps: its
    // 24-register producer spills in the four-warp form) was the limiter of the paged batch, 15-17 %
    // slower than four warps (tools/ab_fa3.py paged / paged_seq, paired medians of 9 rounds).
    constexpr bool kSpread = kPaged && kHeadDim <= 128;
    [[maybe_unused]] constexpr int kBoxesPerWarp = (kBlockN / 8 + 3) / 4;  // page_size >= 8
    const int lane = threadIdx.x % 32, pwarp = threadIdx.x / 32;
    // Pages that hold a whole KV tile make one box per tile: warps 1-3 would have nothing to issue
    // but would still wait on every stage, taking issue slots from the consumers on their
    // schedulers (tools/ab_fa3.py, page 128: x1.025-1.029 with them gone).
    const bool idle = kSpread && pwarp != 0 && p.page_size >= kBlockN;
    const bool writer = pwarp == 0 && lane == 0;  // publishes the tiles and loads their Q
    // fp8 K/V: warp 0 issues every load (lane j box j of a paged tile), warps 1-3 widen. A thread
    // that both issued and widened waited for each tile to land before it could issue the next
    // one, which left one tile in flight instead of the ring's lead: 2868 us against 1122 for a
    // bf16 cache (paged 16 x 2048, H200), 2505 against 1097 with the widening split around the
    // V issue (H100).
    const bool issuer = kKV8 ? pwarp == 0 && lane < (kPaged ? 32 : 1)
                             : !idle && (kSpread ? lane == 0 : pwarp == 0 && lane < (kPaged ? 32 : 1));
    const bool widener = kKV8 && pwarp != 0;
    // Multicast: the cluster's CTAs take tiles 2u and 2u + 1 (query heads 2h, 2h + 1 of one KV
    // head, the same KV tiles), the cluster index snaking as a CTA does without; rank r loads
    // column box r of every K and V tile for both.
    const int rank = mc ? int(cluster_rank()) : 0;
    if (issuer || widener) {
      int kv_it = 0;  // KV tiles loaded by this CTA so far (all its work tiles): stage and phase
      int q_it = 0;   // tiles published so far
      // The single Q buffer (and so the next descriptor slot) is free once both consumer
      // warpgroups are done with the previous tile's Q: at its start with kQInRegs (the Q load
      // overlaps that whole tile), else after its last Q K^T (the load overlaps their last P V
      // and epilogue). Either way the slot written next held a tile that both warpgroups
      // finished before they released the previous tile's Q (see TileDesc).
      auto publish = [&](int kind, const Tile& w) {
        mbar_wait(&ss.empty_q, (q_it & 1) ^ 1);
        int* d = ss.tiles[q_it % kDescSlots];
        sts(&d[kDescKind], kind);
        if (kind != kTileEnd) {
          sts(&d[kDescRowDiag], w.m_block * kBlockM + w.diag);
          sts(&d[kDescKvLen], w.kv_len);
          sts(&d[kDescNStart], w.n_start);
          sts(&d[kDescNEnd], w.n_end);
          sts(&d[kDescQRow], w.qo_start + w.m_block * kBlockM);
          sts(&d[kDescRows], min(kBlockM, w.qo_len - w.m_block * kBlockM));
          sts(&d[kDescHead], w.head);
#if FI_CUSTOM_MASK
          sts(&d[kDescMaskByte], w.mask_byte);
          sts(&d[kDescMaskLen], w.mask_len);
          sts(&d[kDescMRow], w.m_block * kBlockM);
#endif
        }
        if (kind == kTileWork) {
          mbar_expect_tx(&ss.bar_q, kQBytes);  // arrives: releases the descriptor with it
          for (int bx = 0; bx < kBoxes; ++bx)
            tma_load_rows(&ss.q[bx * kBlockM * kBoxCols], &p.tma_q, &ss.bar_q, bx * kBoxCols, w.head,
                          w.qo_start + w.m_block * kBlockM, p.q_heads_outer);
        } else {
          mbar_arrive(&ss.bar_q);
        }
      };
      // fp8 K/V: widen tile j in its stage (j % kStages) once its raw half has landed (the consumers
      // released the stage before its TMA was issued). The widening threads wait on nothing else,
      // so they cannot close a cycle with the publish (which waits for the consumers).
      [[maybe_unused]] auto widen = [&](int j, uint64_t* raw_full, uint64_t* full, Element* base) {
        const int s = j % kStages;
        mbar_wait(&raw_full[s], (j / kStages) & 1);
        widen_tile(smem_u32(&base[s * kBlockN * kHeadDim]), threadIdx.x - 32);
        fence_proxy_async();
        mbar_arrive(&full[s]);
      };
      for (int round = 0;; ++round) {
        const int t = mc ? 2 * tile_of(round, cta >> 1, grid >> 1) + rank : tile_of(round, cta, grid);
        if (t >= num_tiles || (!kPersistent && round > 0)) break;
        const Tile w = tile_info(p, t);
        if (!w.valid) continue;  // past the request's queries: nothing to write
        const bool keys = w.n_end > w.n_start;
        if (writer) publish(keys ? kTileWork : kTileNoKeys, w);
        ++q_it;
        if (!keys) continue;
        const int kv_head = w.head / p.group_size;
#if FI_PAGED
        // The 16-bit paged producers' page arithmetic, once per work tile (below).
        [[maybe_unused]] const int sp_boxes = kBlockN / min(p.page_size, kBlockN);
        [[maybe_unused]] const int sp_page_tiles = max(1, p.page_size / kBlockN);
        [[maybe_unused]] const int sp_last_page = fi::ceil_div(w.kv_len, p.page_size) - 1;
#endif
        for (int n = w.n_end - 1; n >= w.n_start; --n, ++kv_it) {
          const int s = kv_it % kStages;
          const uint32_t empty_phase = ((kv_it / kStages) & 1) ^ 1;
          if constexpr (kKV8) {
            if (widener) {
              widen(kv_it, ss.raw_full_k, ss.full_k, ss.k);
              widen(kv_it, ss.raw_full_v, ss.full_v, ss.v);
              continue;
            }
            // Raw tile kv_it lands in the upper half of its stage once the consumers released it.
            uint8_t* k_dst = reinterpret_cast<uint8_t*>(&ss.k[s * kBlockN * kHeadDim]) + kRawBytes;
            uint8_t* v_dst = reinterpret_cast<uint8_t*>(&ss.v[s * kBlockN * kHeadDim]) + kRawBytes;
#if FI_PAGED
            // Lane j issues box j. Its page by a division per lane: the sum-and-clamp form of the
            // 16-bit producers below (sp_*, then live through this loop) ran x0.993 and x0.926 in
            // turns here (tools/ab_fa3.py paged_e4m3, H100, 7 and 15 rounds,
            // prefill_fa3_ab_session50_page_index_r7.json / _page_index.json); not kept.
            const int box_rows = min(p.page_size, kBlockN);
            const int boxes = kBlockN / box_rows;
            const int num_pages = fi::ceil_div(w.kv_len, p.page_size);
            const int in_page = (n * kBlockN) % p.page_size;
            const int c1 = p.heads_outer ? in_page : kv_head;
            const int c2 = p.heads_outer ? kv_head : in_page;
            const bool mine = lane < boxes;  // lane j issues box j
            const int pg = mine ? p.kv_indices[w.kv_start + min((n * kBlockN + lane * box_rows) / p.page_size,
                                                                num_pages - 1)]
                                : 0;
            mbar_wait(&ss.empty_k[s], empty_phase);
            if (lane == 0) mbar_expect_tx(&ss.raw_full_k[s], kKVBytes);
            if (mine) tma_load_4d(k_dst + lane * box_rows * kHeadDim, &p.tma_k, &ss.raw_full_k[s], 0, c1, c2, pg);
            mbar_wait(&ss.empty_v[s], empty_phase);
            if (lane == 0) mbar_expect_tx(&ss.raw_full_v[s], kKVBytes);
            if (mine) tma_load_4d(v_dst + lane * box_rows * kHeadDim, &p.tma_v, &ss.raw_full_v[s], 0, c1, c2, pg);
#else
            const int tok = w.kv_start + n * kBlockN;
            mbar_wait(&ss.empty_k[s], empty_phase);
            mbar_expect_tx(&ss.raw_full_k[s], kKVBytes);
            tma_load_rows(k_dst, &p.tma_k, &ss.raw_full_k[s], 0, kv_head, tok, p.kv_heads_outer);
            mbar_wait(&ss.empty_v[s], empty_phase);
            mbar_expect_tx(&ss.raw_full_v[s], kKVBytes);
            tma_load_rows(v_dst, &p.tma_v, &ss.raw_full_v[s], 0, kv_head, tok, p.kv_heads_outer);
#endif
            continue;
          }
#if FI_PAGED
          const int box_rows = min(p.page_size, kBlockN);  // host checks: page_size | kBlockN or kBlockN | page_size
          // With sp_boxes > 1 every box starts a page and KV tile n holds pages n * sp_boxes .. n *
          // sp_boxes + sp_boxes - 1 of the request; with one box the tile is a slice of page n /
          // (page_size / kBlockN). Keys past the request's end (last tile) read its last page; they
          // are masked anyway.
          const int first = sp_boxes > 1 ? n * sp_boxes : n / sp_page_tiles;
          const int in_page = sp_boxes > 1 ? 0 : (n - first * sp_page_tiles) * kBlockN;
          const int c1 = p.heads_outer ? in_page : kv_head;
          const int c2 = p.heads_outer ? kv_head : in_page;
          if constexpr (kSpread) {
            // A sum and a clamp per box, not a division by the runtime page size per box and tile:
            // tools/ab_fa3.py against the division form (H100, paired medians of 7 rounds,
            // prefill_fa3_ab_session49_page_index_committed.json): paged x1.039, pages in order
            // x1.028, page 128 x1.030, ragged (same code) x1.000. The page ids stay loaded right
            // before the waits: loading tile n - 1's under tile n's V wait measured the same.
            int pg[kBoxesPerWarp];  // this warp's page ids, loaded before the waits
            CUTE_UNROLL
            for (int i = 0; i < kBoxesPerWarp; ++i) {
              const int j = pwarp + 4 * i;
              pg[i] = j < sp_boxes ? p.kv_indices[w.kv_start + min(first + j, sp_last_page)] : 0;
            }
            // K first (its stage frees earlier), then V. Warp 0 owns the expect_tx. Another
            // warp's boxes may land before it: the phase cannot complete before that arrive
            // (count 1), and the transaction count may go negative meanwhile. K and V are written
            // out rather than through one lambda as below: the lambda form changed the SASS of
            // these modules (16 to ~1600 instructions of the kernel, session 36), not measured.
            mbar_wait(&ss.empty_k[s], empty_phase);
            if (pwarp == 0) mbar_expect_tx(&ss.full_k[s], kKVBytes);
            CUTE_UNROLL
            for (int i = 0; i < kBoxesPerWarp; ++i) {
              const int j = pwarp + 4 * i;
              if (j < sp_boxes) {
                Element* k_dst = &ss.k[s * kBlockN * kHeadDim + j * box_rows * kBoxCols];
                if (mc)
                  tma_load_4d_mc(k_dst + rank * kBlockN * kBoxCols, &p.tma_k, &ss.full_k[s], 3, rank * kBoxCols, c1, c2,
                                 pg[i]);
                else
                  for (int bx = 0; bx < kBoxes; ++bx)
                    tma_load_4d(k_dst + bx * kBlockN * kBoxCols, &p.tma_k, &ss.full_k[s], bx * kBoxCols, c1, c2, pg[i]);
              }
            }
            mbar_wait(&ss.empty_v[s], empty_phase);
            if (pwarp == 0) mbar_expect_tx(&ss.full_v[s], kKVBytes);
            CUTE_UNROLL
            for (int i = 0; i < kBoxesPerWarp; ++i) {
              const int j = pwarp + 4 * i;
              if (j < sp_boxes) {
                Element* v_dst = &ss.v[s * kBlockN * kHeadDim + j * box_rows * kBoxCols];
                if (mc)
                  tma_load_4d_mc(v_dst + rank * kBlockN * kBoxCols, &p.tma_v, &ss.full_v[s], 3, rank * kBoxCols, c1, c2,
                                 pg[i]);
                else
                  for (int bx = 0; bx < kBoxes; ++bx)
                    tma_load_4d(v_dst + bx * kBlockN * kBoxCols, &p.tma_v, &ss.full_v[s], bx * kBoxCols, c1, c2, pg[i]);
              }
            }
          } else {  // d = 256: warp 0, lane j issues box j; lane 0 does the barrier work
            // The page by the same sum and clamp, not a division per lane: x1.107 in turns against
            // it (tools/ab_fa3.py paged_d256, H100, 15 rounds, prefill_fa3_ab_session50_d256_committed.json).
            const int page = lane < sp_boxes ? p.kv_indices[w.kv_start + min(first + lane, sp_last_page)] : 0;
            auto load = [&](Element* ring, const CUtensorMap* map, uint64_t* full, uint64_t* empty) {
              if (lane == 0) {
                mbar_wait(empty, empty_phase);
                mbar_expect_tx(full, kKVBytes);
              }
              __syncwarp();
              if (lane < sp_boxes) {
                Element* dst = &ring[s * kBlockN * kHeadDim + lane * box_rows * kBoxCols];
                for (int bx = 0; bx < kBoxes; ++bx)
                  tma_load_4d(dst + bx * kBlockN * kBoxCols, map, full, bx * kBoxCols, c1, c2, page);
              }
            };
            load(ss.k, &p.tma_k, &ss.full_k[s], &ss.empty_k[s]);
            load(ss.v, &p.tma_v, &ss.full_v[s], &ss.empty_v[s]);
            __syncwarp();
          }
#else
          const int tok = w.kv_start + n * kBlockN;
          const int r1 = p.kv_heads_outer ? tok : kv_head, r2 = p.kv_heads_outer ? kv_head : tok;
          auto load = [&](Element* stage, const CUtensorMap* map, uint64_t* full, uint64_t* empty) {
            mbar_wait(empty, empty_phase);
            mbar_expect_tx(full, kKVBytes);
            if (mc)
              tma_load_3d_mc(stage + rank * kBlockN * kBoxCols, map, full, 3, rank * kBoxCols, r1, r2);
            else
              for (int bx = 0; bx < kBoxes; ++bx)
                tma_load_rows(stage + bx * kBlockN * kBoxCols, map, full, bx * kBoxCols, kv_head, tok,
                              p.kv_heads_outer);
          };
          load(&ss.k[s * kBlockN * kHeadDim], &p.tma_k, &ss.full_k[s], &ss.empty_k[s]);
          load(&ss.v[s * kBlockN * kHeadDim], &p.tma_v, &ss.full_v[s], &ss.empty_v[s]);
#endif
        }
      }
      if (writer) publish(kTileEnd, Tile{});
    }
    if constexpr (mc) {  // the other CTA may still multicast into this one and arrive on its barriers
      __syncwarp();
      cluster_sync();
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  reg_alloc<kConsumerRegs>();
  const int tid = threadIdx.x - 128;
  TiledMmaQK mma_qk;
  TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q), SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k), SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v), SmemLayoutVt{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // descriptors (SS) or registers (kQInRegs)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (mma, n, k, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (mma, d, k, stage)

  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor tOrP = make_tensor<Element>(LayoutP{});
  static_assert(size(tOrP) == size(tSrS), "P must mirror S");
  uint32_t* p32 = reinterpret_cast<uint32_t*>(raw_pointer_cast(tOrP.data()));

  // Tile coordinates (row, col) of each accumulator value, from the same partitioning.
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  int row_in_tile[2];
  row_in_tile[0] = get<0>(tScS(0));
  row_in_tile[1] = get<0>(tScS(2));

  int q_it = 0;  // tiles received so far; the current one's descriptor (TileDesc) is read at each use
  int dslot = 0;  // q_it % kDescSlots
  auto desc = [&](int field) { return lds(&ss.tiles[dslot][field]); };
  auto row_diag_of = [&]() { return desc(kDescRowDiag); };
  auto kv_len_of = [&]() { return desc(kDescKvLen); };
  const int window = p.window_left;
  const float sl2 = p.scale_log2;
  // Soft cap: S <- tanh(S * sm_scale / cap); the cap itself is folded into sl2.
  auto apply_softcap = [&]() {
    const float pre = p.softcap_pre;
    CUTE_UNROLL
    for (int v = 0; v < size(tSrS); ++v) tSrS(v) = fi::tanh_approx(tSrS(v) * pre);
  };
  float row_max[2] = {fi::kNegInf, fi::kNegInf};
  float row_sum[2] = {0.f, 0.f};

#if FI_CUSTOM_MASK
  constexpr int kWindows = (kBlockN + 31) / 32;
  // The raw mask windows of KV tile n for this thread's two rows (no range folded in yet), as
  // aligned words (fi::mask_windows32): loaded before the Q K^T wait so that their latency hides
  // under the GEMM.
  auto load_mask = [&](int n, uint32_t (&raw)[2][kWindows]) {
    const int kv_len = kv_len_of();
    const int base = n * kBlockN + get<1>(tScS(0));
    const uint8_t* mask = p.mask + desc(kDescMaskByte);
    const uint8_t* mask_end = mask + desc(kDescMaskLen);
    const int m_row = desc(kDescMRow), rows = desc(kDescRows);
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      if (row_in_tile[i] < rows) {
        fi::mask_windows32(mask, mask_end, int64_t(m_row + row_in_tile[i]) * kv_len, base, kv_len, raw[i]);
      } else {
        CUTE_UNROLL
        for (int wi = 0; wi < kWindows; ++wi) raw[i][wi] = 0u;
      }
    }
  };
  uint32_t mraw[2][kWindows];
#endif
  // Masks columns of KV tile n that are past the request's keys or (causal) above the diagonal.
  auto mask_tile = [&](int n, bool preloaded = false) {
    const int row_diag = row_diag_of(), kv_len = kv_len_of();
    // Column bounds per row of this thread, relative to its first column of the tile: the
    // per-value offsets below are compile-time constants, so each value costs two compares and
    // no branch (a per-value `if (window >= 0)` kept extra registers live at the loop's peak).
    const int base = n * kBlockN + get<1>(tScS(0));
    int hi[2], lo[2];
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      const int lim = row_in_tile[i] + row_diag;  // = row + diag: the row's last causal key
      hi[i] = (kCausal ? min(kv_len - 1, lim) : kv_len - 1) - base;
      lo[i] = window >= 0 ? lim - window - base : (kCustomMask ? -1 : INT_MIN);
    }
#if FI_CUSTOM_MASK
    {
      // Row i's bits for this thread's columns base + c, 32 per window, ANDed with its visible
      // range [lo, hi]; rows past the tile's queries read no mask. Accumulator value v is row
      // (v / 2) % 2, column 8 (v / 4) + v % 2 of the thread's (wgmma's C layout), so window v / 16
      // holds it: the window index is a compile-time constant (a runtime index would put the
      // windows, and with them S, in local memory).
      static_assert(kBlockN % 8 == 0 && size(decltype(tSrS){}) == kBlockN / 2, "wgmma C layout assumed");
      if (!preloaded) load_mask(n, mraw);
      // The range only cuts into a tile that crosses the request's last key or under a sliding
      // window (custom masks are never causal, and lo is -1 otherwise): elsewhere the fold is
      // skipped (a warp-uniform branch).
      if (window >= 0 || (n + 1) * kBlockN > kv_len) {
        CUTE_UNROLL
        for (int wi = 0; wi < kWindows; ++wi) {
          CUTE_UNROLL
          for (int i = 0; i < 2; ++i) mraw[i][wi] &= fi::range_bits32(lo[i] - 32 * wi, hi[i] + 1 - 32 * wi);
        }
      }
      CUTE_UNROLL
      for (int wi = 0; wi < kWindows; ++wi) {
        CUTE_UNROLL
        for (int v = 0; v < size(tSrS); ++v) {
          if (v / 16 != wi) continue;  // resolved at compile time (both unrolled)
          const int c = get<1>(tScS(v)) - get<1>(tScS(0)) - 32 * wi;  // 0..31
          if (!((mraw[row_of(v)][wi] >> c) & 1u)) tSrS(v) = fi::kNegInf;
        }
      }
    }
#else
    CUTE_UNROLL
    for (int v = 0; v < size(tSrS); ++v) {
      const int c = get<1>(tScS(v)) - get<1>(tScS(0));
      if (c > hi[row_of(v)] || c < lo[row_of(v)]) tSrS(v) = fi::kNegInf;
    }
#endif
  };
  // Only tiles that cross the sequence end or (causal) the diagonal of this query tile need masks.
  auto needs_mask = [&](int n) {
    if constexpr (kCustomMask) return true;
    const int last_col = (n + 1) * kBlockN - 1;
    const int row_diag = row_diag_of(), kv_len = kv_len_of();
    return last_col >= kv_len || (kCausal && last_col > row_diag) ||
           (window >= 0 && n * kBlockN < row_diag + kBlockM - 1 - window);
  };
  // Online softmax on tSrS in place: new running max, P = 2^(S*scale - max*scale), rescale factor
  // for the previous O and row sums. Row sums stay per-thread partial until the end.
  auto softmax = [&](float (&rescale)[2]) {
    float mx[2] = {row_max[0], row_max[1]};
    CUTE_UNROLL
    for (int v = 0; v < size(tSrS); ++v) mx[row_of(v)] = fmaxf(mx[row_of(v)], tSrS(v));
    float mscaled[2];
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      mx[i] = quad_max(mx[i]);
      // A row with no visible key so far keeps max -inf; use 0 so -inf - max does not give NaN.
      mscaled[i] = mx[i] == fi::kNegInf ? 0.f : mx[i] * sl2;
      rescale[i] = fi::exp2_approx(row_max[i] == fi::kNegInf ? fi::kNegInf : row_max[i] * sl2 - mscaled[i]);
      row_max[i] = mx[i];
      row_sum[i] *= rescale[i];
    }
    CUTE_UNROLL
    for (int v = 0; v < size(tSrS); ++v) {
      const float e = fi::exp2_approx(fmaf(tSrS(v), sl2, -mscaled[row_of(v)]));
      tSrS(v) = e;
      row_sum[row_of(v)] += e;
    }
  };
  // Each bracket sync(mine) .. arrive(other's) passes the turn; both warpgroups of a CTA walk the
  // same KV tiles, so the brackets pair up. WG2 gives WG1 the first turn; WG1 takes the last
  // pending arrive before exiting so no barrier is left half-arrived.
  const int wg_c = wg - 1;  // 0 or 1
  auto sched_sync = [&]() { if (kPingPong) named_sync(kSchedBarrier + wg_c, kConsumerThreads); };
  auto sched_arrive = [&]() { if (kPingPong) named_arrive(kSchedBarrier + (wg_c ^ 1), kConsumerThreads); };
  if (kPingPong && wg_c == 1) named_arrive(kSchedBarrier + 0, kConsumerThreads);

  // O *= the factor of the latest softmax, per row (after the P V that preceded that softmax).
  auto rescale_o = [&](const float (&rescale)[2]) {
    CUTE_UNROLL
    for (int v = 0; v < size(tOrO); ++v) tOrO(v) *= rescale[row_of(v)];
  };
  auto convert_p = [&]() {
    CUTE_UNROLL
    for (int v = 0; v < size(tSrS) / 2; ++v) p32[v] = pack2(tSrS(2 * v), tSrS(2 * v + 1));
  };

  // A K or V stage is done with: one arrive per thread, and with multicast also one per warp on
  // the stage's barrier in the other CTA (whose producer refills this CTA's half of it).
  const uint32_t peer = mc ? (cluster_rank() ^ 1u) : 0u;
  auto release = [&](uint64_t* bar) {
    mbar_arrive(bar);
    if constexpr (mc) {
      __syncwarp();
      if (threadIdx.x % 32 == 0) mbar_arrive_cta(bar, peer);
    }
  };

  // Normalise O by the row sums and write it and the base-2 LSE of the tile in descriptor slot
  // `slot`. Straight from registers (no smem), so the producer's loads for the next tile proceed
  // meanwhile. Both warpgroups run it at once, and without kQKAhead with no GEMM of theirs in
  // flight, so its cost is a per-work-tile overhead: clock64 stamps per tile (H100, ragged 16 x
  // 2048, session 51) put it at 4100-4200 cycles when each lane stored its 4-byte pairs (16 bytes
  // per row and instruction), 2100 with the 16-byte stores below, 2200 with no O stores at all (a
  // diagnostic build); a work tile costs ~2530 cycles per KV tile plus a fixed part that this cut
  // from ~5500 to ~3650. tools/ab_fa3.py in turns against the pair stores (9 rounds,
  // prefill_fa3_ab_session51_epilogue.json): ragged x1.077, paged x1.079, single 4k x1.047, single
  // 16k x1.007. Its stores are predicated, not branched over (stg*_if), so that it has no divergent
  // branch where kQKAhead places it.
  auto epilogue = [&](int slot, const float (&sum)[2], const float (&mx)[2]) {
    const int* d = ss.tiles[slot];
    const int rows = lds(&d[kDescRows]), q_row = lds(&d[kDescQRow]), head = lds(&d[kDescHead]);
    float tot[2], inv[2];
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      tot[i] = quad_sum(sum[i]);
      inv[i] = tot[i] > 0.f ? p.out_scale * (1.f / tot[i]) : 0.f;  // a reciprocal, not a division
    }
    Element* o_tile = p.o + int64_t(head) * p.o_head + int64_t(q_row) * p.o_tok;
    // A quad of lanes holds 16 bytes of a row in each 8-column chunk, 4 per lane (wgmma's C
    // layout). A 4 x 4 transpose inside the quad (two shuffle rounds) gives lane q all of chunks
    // q, q + 4, ...: 16-byte stores (the runner checks o's 16-byte alignment), a quarter of the
    // instructions, 64 contiguous bytes per row.
    // Value v of a lane is row half (v / 2) % 2, column 8 (v / 4) + 2 quad + v % 2, as in mask_tile.
    static_assert(size(decltype(tOrO){}) == kHeadDim / 2 && kHeadDim % 32 == 0, "wgmma C layout assumed");
    const int quad = tid % 4;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = get<0>(tOcO(2 * h));
      CUTE_UNROLL
      for (int i = 0; i < kHeadDim / 32; ++i) {
        uint32_t a[4];
        CUTE_UNROLL
        for (int k = 0; k < 4; ++k) {
          const int v = 4 * (4 * i + k) + 2 * h;  // chunk 4i + k, row half h
          a[k] = pack2(tOrO(v) * inv[h], tOrO(v + 1) * inv[h]);
        }
        CUTE_UNROLL
        for (int m = 1; m <= 2; m <<= 1) {
          const bool hi = (quad & m) != 0;
          CUTE_UNROLL
          for (int k = 0; k < 4; ++k) {
            if (k & m) continue;
            const uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? a[k] : a[k | m], m);
            if (hi)
              a[k] = got;
            else
              a[k | m] = got;
          }
        }
        stg128_if(r < rows, o_tile + int64_t(r) * p.o_tok + 8 * (4 * i + quad), make_uint4(a[0], a[1], a[2], a[3]));
      }
    }
    if (p.lse != nullptr) {
      CUTE_UNROLL
      for (int i = 0; i < 2; ++i) {
        const int r = row_in_tile[i];
        const float l = tot[i] > 0.f ? mx[i] * sl2 + fi::log2_approx(tot[i]) : fi::kNegInf;
        stg32_if(r < rows && (tid % 4) == 0, p.lse + (int64_t(q_row + r) * p.num_qo_heads + head), l);
      }
    }
  };

  int kv_it = 0;  // KV tiles consumed by this CTA so far: stage and phase, in step with the producer
  // kCrossTile: the previous tile (descriptor slot pslot) still owes its last P V (P holds its
  // P(n_start), O its partial output, row_max / row_sum its statistics; its V is KV tile
  // kv_it - 1, already counted) and its epilogue.
  bool pending = false;
  int pslot = 0;
  // The last P V of a tile on its own (V = KV tile `it`), then its epilogue: every tile without
  // kCrossTile; with it, the tile before an end or a tile without keys. kv_it advances at the
  // same places on every path (a count that depended on `pending` made ptxas keep it, and the
  // wgmma descriptors of the KV loop, in vector registers: R2UR before every HGMMA).
  auto finish = [&](int it, int slot) {
    const int s = it % kStages;
    mbar_wait(&ss.full_v[s], (it / kStages) & 1);
    gemm_issue<false, true>(mma_pv, tOrP, tOrV(_, _, _, s), tOrO);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    release(&ss.empty_v[s]);
    epilogue(slot, row_sum, row_max);
  };
  for (;; ++q_it, dslot = dslot + 1 == kDescSlots ? 0 : dslot + 1) {
    // A CTA of the non-persistent launch (d = 256) has one tile; saying so keeps the loop's state
    // out of the registers of its consumers, which sit at the 240-register limit.
    if (!kPersistent && q_it > 0) break;
    // The producer's arrive on bar_q publishes the tile (and, for a work tile, its Q lands).
    mbar_wait(&ss.bar_q, q_it & 1);
    const int kind = desc(kDescKind);
    if (kCrossTile && pending && kind != kTileWork) {
      finish(kv_it - 1, pslot);
      pending = false;
    }
    if (kind == kTileEnd) break;
    if (kind == kTileNoKeys) {
      // No row of this tile sees any key: O = 0, lse = -inf (FlashInfer's convention). The
      // producer loads no Q or K/V for it.
      const int rows = desc(kDescRows), q_row = desc(kDescQRow), head = desc(kDescHead);
      for (int idx = tid; idx < rows * kHeadDim; idx += kConsumerThreads) {
        const int r = idx / kHeadDim, c = idx % kHeadDim;
        p.o[int64_t(q_row + r) * p.o_tok + int64_t(head) * p.o_head + c] = Element(0.f);
      }
      if (p.lse != nullptr)
        for (int r = tid; r < rows; r += kConsumerThreads) p.lse[int64_t(q_row + r) * p.num_qo_heads + head] = fi::kNegInf;
      mbar_arrive(&ss.empty_q);  // done with the descriptor: the producer may publish the next
      continue;
    }
    const int n_start = desc(kDescNStart);
    int n = desc(kDescNEnd) - 1;
    // The previous tile's statistics, for its epilogue after this tile's first softmax.
    float prev_sum[2], prev_max[2];
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      prev_sum[i] = row_sum[i];
      prev_max[i] = row_max[i];
      row_max[i] = fi::kNegInf;
      row_sum[i] = 0.f;
    }
    if (!(kCrossTile && pending)) {
      CUTE_UNROLL
      for (int v = 0; v < size(tOrO); ++v) tOrO(v) = 0.f;
    }

    float rescale[2];  // the O factor of the latest softmax
    if constexpr (kQInRegs) {
      auto q_copy = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_qk);
      auto q_thr = q_copy.get_thread_slice(tid);
      Tensor tQs = q_thr.partition_S(sQ);
      Tensor tQr = q_thr.retile_D(tSrQ);
      cute::copy(q_copy, tQs, tQr);
      mbar_arrive(&ss.empty_q);  // Q is in registers: the next tile's Q may load
    }
    if (kCrossTile && pending) {
      // S(n) = Q K(n)^T of this tile runs with the previous tile's last P V queued behind it; this
      // tile's first mask and row max run under that P V, the previous tile's epilogue after it.
      const int sv = (kv_it - 1) % kStages, sk = kv_it % kStages;
      mbar_wait(&ss.full_k[sk], (kv_it / kStages) & 1);
      mbar_wait(&ss.full_v[sv], ((kv_it - 1) / kStages) & 1);
      sched_sync();
      gemm_issue<true, kQInRegs>(mma_qk, tSrQ, tSrK(_, _, _, sk), tSrS);
      gemm_issue<false, true>(mma_pv, tOrP, tOrV(_, _, _, sv), tOrO);
      sched_arrive();
      warpgroup_wait<1>();  // S(n) ready; the P V still running
      warpgroup_fence_operand(tSrS);
      release(&ss.empty_k[sk]);
      if (kSoftcap) apply_softcap();
      if (needs_mask(n)) mask_tile(n);
      softmax(rescale);  // this tile's O starts at zero: its factor is applied to nothing
      // The mbarrier wait ends the basic block, which keeps ptxas from hoisting the wgmma wait to
      // the row max (see the KV loop); it is this tile's first V, needed by its next P V anyway.
      // ptxas still sinks the exponentials below the wait (nvcc 13.0: they feed only convert_p),
      // and neither a register fence nor __syncwarp() kept them above it.
      mbar_wait(&ss.full_v[sk], (kv_it / kStages) & 1);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      release(&ss.empty_v[sv]);
      convert_p();
      if constexpr (!kQKAhead) {
        epilogue(pslot, prev_sum, prev_max);
        CUTE_UNROLL
        for (int v = 0; v < size(tOrO); ++v) tOrO(v) = 0.f;
      }
    } else {
      const int s = kv_it % kStages;
      mbar_wait(&ss.full_k[s], (kv_it / kStages) & 1);
      sched_sync();
      gemm_issue<true, kQInRegs>(mma_qk, tSrQ, tSrK(_, _, _, s), tSrS);
      sched_arrive();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      release(&ss.empty_k[s]);
      if (!kQInRegs && n == n_start) mbar_arrive(&ss.empty_q);  // that was this tile's last Q K^T
      if (kSoftcap) apply_softcap();
      mask_tile(n);  // the last KV tile always may cross the sequence end or the diagonal
      softmax(rescale);  // O is still zero: its factor is applied to nothing
      convert_p();
    }
    if constexpr (kRotatedLoop) {
      // The KV loop, rotated: each step ends by issuing the next step's GEMMs, so that every issue
      // reaches the wait at the top of the next step on every path (a loop that re-tested
      // n > n_start for kQKAhead's early Q K^T left paths, never taken but ptxas cannot tell, with
      // it in flight past the loop). With kQKAhead the previous tile's epilogue, still owed after
      // the cross-tile block above, runs between this tile's second Q K^T and its first P V, on the
      // CUDA cores while the tensor cores compute that Q K^T (without it, both warpgroups spent its
      // ~2100 cycles per work tile with the tensor cores idle). The first P V starts from zero
      // (wgmma scale-d 0), so O needs no clearing with the Q K^T in flight: ptxas serialises every
      // wgmma of the kernel when non-wgmma instructions write an accumulator there (C7515).
      const bool owed = kQKAhead && pending;
      if (n > n_start) {
        {
          const int s = kv_it % kStages, s_next = (kv_it + 1) % kStages;
          mbar_wait(&ss.full_k[s_next], ((kv_it + 1) / kStages) & 1);
          sched_sync();
          gemm_issue<true, kQInRegs>(mma_qk, tSrQ, tSrK(_, _, _, s_next), tSrS);
          sched_arrive();
          if (owed) epilogue(pslot, prev_sum, prev_max);
          mbar_wait(&ss.full_v[s], (kv_it / kStages) & 1);
          sched_sync();
          gemm_issue<true, true>(mma_pv, tOrP, tOrV(_, _, _, s), tOrO);  // O = P V: O is not cleared
          sched_arrive();
        }
        for (;;) {
          const int s = kv_it % kStages;
          const int s_next = (kv_it + 1) % kStages;
#if FI_CUSTOM_MASK
          load_mask(n - 1, mraw);  // under the GEMMs
#endif
          warpgroup_wait<1>();  // S(n-1) ready (K stage s_next read); P V still running
          warpgroup_fence_operand(tSrS);
          release(&ss.empty_k[s_next]);
          if (!kQInRegs && n - 1 == n_start) mbar_arrive(&ss.empty_q);  // see the loop below
          if (kSoftcap) apply_softcap();
          if (needs_mask(n - 1)) mask_tile(n - 1, kCustomMask);
          softmax(rescale);
          mbar_wait(&ss.full_v[s_next], ((kv_it + 1) / kStages) & 1);  // see the loop below
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          release(&ss.empty_v[s]);
          rescale_o(rescale);
          convert_p();
          --n;
          ++kv_it;
          if (n == n_start) break;
          const int t = kv_it % kStages, t_next = (kv_it + 1) % kStages;
          mbar_wait(&ss.full_k[t_next], ((kv_it + 1) / kStages) & 1);
          mbar_wait(&ss.full_v[t], (kv_it / kStages) & 1);
          sched_sync();
          gemm_issue<true, kQInRegs>(mma_qk, tSrQ, tSrK(_, _, _, t_next), tSrS);
          gemm_issue<false, true>(mma_pv, tOrP, tOrV(_, _, _, t), tOrO);
          sched_arrive();
        }
      } else if (owed) {
        epilogue(pslot, prev_sum, prev_max);
        CUTE_UNROLL
        for (int v = 0; v < size(tOrO); ++v) tOrO(v) = 0.f;
      }
    } else {
      // d = 256: the same steps, unrotated. The rotated loop ran single 4k at d = 256 x0.974 and
      // paged x0.996 (tools/ab_fa3.py in turns, 11 rounds, H100, session 53), soft cap x1.025.
      for (; n > n_start; --n, ++kv_it) {
        const int s = kv_it % kStages;
        const int s_next = (kv_it + 1) % kStages;
        // S(n-1) = Q K(n-1)^T runs on the tensor cores while ...
        mbar_wait(&ss.full_k[s_next], ((kv_it + 1) / kStages) & 1);
        mbar_wait(&ss.full_v[s], (kv_it / kStages) & 1);
        sched_sync();
        gemm_issue<true, kQInRegs>(mma_qk, tSrQ, tSrK(_, _, _, s_next), tSrS);
        // ... O += P(n) V(n) is queued behind it.
        gemm_issue<false, true>(mma_pv, tOrP, tOrV(_, _, _, s), tOrO);
        sched_arrive();
#if FI_CUSTOM_MASK
        load_mask(n - 1, mraw);  // under the GEMMs
#endif
        warpgroup_wait<1>();  // S(n-1) ready (K stage s_next read); P V still running
        warpgroup_fence_operand(tSrS);
        release(&ss.empty_k[s_next]);
        if (!kQInRegs && n - 1 == n_start) mbar_arrive(&ss.empty_q);  // last Q K^T: the next tile's Q may load
        if (kSoftcap) apply_softcap();
        if (needs_mask(n - 1)) mask_tile(n - 1, kCustomMask);
        softmax(rescale);
        // Wait for the next P V's V stage here, before the P V wait: the mbarrier poll loop ends
        // a basic block, and ptxas hoists a wgmma wait (WARPGROUP.DEPBAR) to the top of its block.
        // Without this the wait for P(n) V(n) sat above the softmax (seen in the SASS), which then
        // ran after the GEMM instead of under it. tools/ab_fa3.py against that source (H200,
        // paired medians of 11 rounds): single prefill 4.1-4.7 % faster, the ragged batch 2.6 %.
        mbar_wait(&ss.full_v[s_next], ((kv_it + 1) / kStages) & 1);
        warpgroup_wait<0>();  // P V done: V stage s is free, P registers and O may be rewritten
        warpgroup_fence_operand(tOrO);
        release(&ss.empty_v[s]);
        // O is rescaled here rather than between the Q K^T and P V issues (FA3's order for d = 256):
        // 1.2-3.0 % faster on every case of tools/ab_fa3.py (paired medians, 11 rounds, H200).
        rescale_o(rescale);
        convert_p();
      }
    }
    if constexpr (kCrossTile) {
      pending = true;  // the last P V goes with the next tile's first Q K^T
      pslot = dslot;
    } else {
      finish(kv_it, dslot);
    }
    ++kv_it;
  }
  // The turn passing continues across tiles (both warpgroups walk the same tiles with the same
  // number of GEMM brackets); WG1 takes WG2's last pending arrive before exiting.
  if (kPingPong && wg_c == 0) named_sync(kSchedBarrier + 0, kConsumerThreads);
  if constexpr (mc) {  // see the producer's exit
    __syncwarp();
    cluster_sync();
  }
}

// ---- host side --------------------------------------------------------------------------------
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point, so the module needs no -lcuda.
inline EncodeTiledFn encode_fn() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return EncodeTiledFn(nullptr);
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// How a map reads its tensor: 16-bit elements in 64-column boxes, 128B-swizzled (Q, and 16-bit
// K/V), or fp8 K/V (kKV8) as whole unswizzled rows of kHeadDim bytes for the widening threads.
struct MapFormat {
  CUtensorMapDataType type;
  uint32_t elem_bytes, box_cols;
  CUtensorMapSwizzle swizzle;
};
constexpr MapFormat kQFormat = {FI_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                uint32_t(sizeof(Element)), uint32_t(kBoxCols), CU_TENSOR_MAP_SWIZZLE_128B};
constexpr MapFormat kKVFormat =
    kKV8 ? MapFormat{CU_TENSOR_MAP_DATA_TYPE_UINT8, 1u, uint32_t(kHeadDim), CU_TENSOR_MAP_SWIZZLE_NONE} : kQFormat;

// Map over a [tokens, heads, kHeadDim] tensor (strides in elements, last dim contiguous); one box =
// `rows` tokens x box_cols columns of one head. Out-of-range tokens read as zeros.
// With heads_outer the dims are (d, token, head), so strides stay increasing for HND-strided views.
inline bool encode_qkv(CUtensorMap* map, const MapFormat& f, const void* ptr, int64_t tokens, int64_t heads,
                       int64_t tok_stride, int64_t head_stride, int rows, bool heads_outer = false) {
  EncodeTiledFn fn = encode_fn();
  if (fn == nullptr) return false;
  if (heads == 1) head_stride = kHeadDim;  // unused by addressing; keep the strides dense-looking
  cuuint64_t dims[3] = {cuuint64_t(kHeadDim), cuuint64_t(heads_outer ? tokens : heads),
                        cuuint64_t(heads_outer ? heads : tokens)};
  cuuint64_t strides[2] = {cuuint64_t(heads_outer ? tok_stride : head_stride) * f.elem_bytes,
                           cuuint64_t(heads_outer ? head_stride : tok_stride) * f.elem_bytes};
  cuuint32_t box[3] = {f.box_cols, heads_outer ? cuuint32_t(rows) : 1u, heads_outer ? 1u : cuuint32_t(rows)};
  cuuint32_t estrides[3] = {1u, 1u, 1u};
  return fn(map, f.type, 3, const_cast<void*>(ptr), dims, strides, box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
            f.swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Map over one half of a paged cache: dims (d, head, token in page, page), or (d, token, head, page)
// when heads_outer (HND: strides stay increasing), with the given element strides; one box =
// min(page_size, kBlockN) tokens x box_cols columns of one head of one page (kKVFormat).
inline bool encode_paged(CUtensorMap* map, const void* ptr, int64_t pages, int64_t page_size, int64_t heads,
                         int64_t page_stride, int64_t tok_stride, int64_t head_stride, bool heads_outer) {
  EncodeTiledFn fn = encode_fn();
  if (fn == nullptr) return false;
  if (heads == 1) head_stride = kHeadDim;  // unused by addressing; keep the strides dense-looking
  const cuuint32_t rows = cuuint32_t(page_size < kBlockN ? page_size : kBlockN);
  const int64_t d1 = heads_outer ? page_size : heads, d2 = heads_outer ? heads : page_size;
  const int64_t s1 = heads_outer ? tok_stride : head_stride, s2 = heads_outer ? head_stride : tok_stride;
  cuuint64_t dims[4] = {cuuint64_t(kHeadDim), cuuint64_t(d1), cuuint64_t(d2), cuuint64_t(pages)};
  const MapFormat& f = kKVFormat;
  cuuint64_t strides[3] = {cuuint64_t(s1) * f.elem_bytes, cuuint64_t(s2) * f.elem_bytes,
                           cuuint64_t(page_stride) * f.elem_bytes};
  cuuint32_t box[4] = {f.box_cols, heads_outer ? rows : 1u, heads_outer ? 1u : rows, 1u};
  cuuint32_t estrides[4] = {1u, 1u, 1u, 1u};
  return fn(map, f.type, 4, const_cast<void*>(ptr), dims, strides, box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
            f.swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Persistent grid size: one CTA per SM (1 CTA/SM fits: 384 threads x 168 registers, ~225 KB of
// smem). `max_ctas` (the FI_FA3_CTAS knob, passed by the runner) overrides it for tests and A/B
// timing: -1 = one CTA per work tile (the non-persistent launch), N > 0 = at most N CTAs (tests
// force several tiles per CTA with small N), 0 = the default.
inline int64_t persistent_ctas(int sms, int64_t max_ctas) {
  if (max_ctas < 0) return int64_t(1) << 40;
  return max_ctas > 0 ? max_ctas : sms;
}

// 2-CTA clusters of this kernel that fit the GPU at once (0: none, or the query failed), asked
// once per device (a benign race: every writer stores the same value).
inline int max_active_pairs(int dev) {
  static int cached[64] = {};  // value + 1; 0 = not asked yet
  if (dev < 0 || dev >= 64) return 0;
  if (cached[dev] == 0) cached[dev] = fi::max_active_clusters(prefill_sm90_kernel, dim3(kThreads), kSmemBytes, 2) + 1;
  return cached[dev] - 1;
}

// Fills the fields shared by both entries and launches a 1-D grid of persistent CTAs.
inline int launch(Params& p, void* o, void* lse, const void* qo_indptr, const void* kv_indptr,
                  int64_t num_qo_heads, int64_t num_kv_heads, int64_t o_tok, int64_t o_head, int64_t batch,
                  int64_t max_qo_len, float sm_scale, float softcap, float out_scale, int64_t window_left,
                  const void* mask, const void* mask_indptr, int64_t max_ctas, cudaStream_t stream) {
  if (kCustomMask != (mask != nullptr)) return cudaErrorInvalidValue;  // wrong module for the call
  p.mask = static_cast<const uint8_t*>(mask);
  p.mask_indptr = static_cast<const int*>(mask_indptr);
  p.o = static_cast<Element*>(o);
  p.lse = static_cast<float*>(lse);
  p.qo_indptr = static_cast<const int*>(qo_indptr);
  p.kv_indptr = static_cast<const int*>(kv_indptr);
  p.o_tok = o_tok;
  p.o_head = o_head;
  p.num_qo_heads = int(num_qo_heads);
  p.group_size = int(num_qo_heads / num_kv_heads);
  p.num_m_blocks = int(fi::ceil_div<int64_t>(max_qo_len, kBlockM));
  if (kSoftcap != (softcap > 0.f)) return cudaErrorInvalidValue;  // wrong module for the call
  p.scale_log2 = kSoftcap ? softcap * fi::kLog2e : sm_scale * fi::kLog2e;
  p.softcap_pre = kSoftcap ? sm_scale / softcap : 0.f;
  p.out_scale = out_scale;
  // A window of 2^30 keys covers any sequence of up to 2^30 keys; clamping keeps the kernel's int
  // column bounds (row + diag - window - column in mask_tile) from overflowing.
  p.window_left = window_left < 0 ? -1 : int(std::min<int64_t>(window_left, int64_t(1) << 30));
  p.batch = int(batch);
  const int64_t num_tiles = int64_t(p.num_m_blocks) * batch * num_qo_heads;
  if (num_qo_heads > 65535 || batch > 65535 || num_tiles >= (int64_t(1) << 30)) return cudaErrorInvalidValue;
  FI_TRY(fi::set_max_dynamic_smem(prefill_sm90_kernel, kSmemBytes));
  int dev = 0;
  FI_TRY(cudaGetDevice(&dev));
  int sms = 0;
  FI_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  int64_t ctas =
      kPersistent ? std::min<int64_t>(num_tiles, std::max<int64_t>(1, persistent_ctas(sms, max_ctas))) : num_tiles;
  if constexpr (kMcast) {
    // Query heads 2h, 2h + 1 must share a KV head (an even group size: the runner's rule), and a
    // persistent grid must be whole clusters that are all resident at once (tiles are assigned
    // statically); one CTA per tile (max_ctas < 0) needs only an even count, which it has.
    if (p.group_size % 2 != 0) return cudaErrorInvalidValue;
    if (max_ctas >= 0) {
      const int pairs = max_active_pairs(dev);
      if (pairs <= 0) return cudaErrorNotSupported;
      ctas = std::max<int64_t>(2, std::min<int64_t>(ctas, 2 * int64_t(pairs)) & ~int64_t(1));
    }
    FI_TRY(fi::launch_cluster(prefill_sm90_kernel, dim3(unsigned(ctas)), dim3(kThreads), kSmemBytes, stream, 2, p));
    return FI_LAUNCH_STATUS();
  }
  prefill_sm90_kernel<<<unsigned(ctas), kThreads, kSmemBytes, stream>>>(p);
  return FI_LAUNCH_STATUS();
}

}  // namespace fi_hopper

#if !FI_PAGED
// q [nnz_q, Hq, D], k/v [nnz_kv, Hkv, D], o [nnz_q, Hq, D] with the given token/head strides (in
// elements; the Python runner checks 16-byte alignment of pointers and strides). lse [nnz_q, Hq]
// fp32 contiguous or NULL. qo_indptr / kv_indptr: device int32 [batch + 1], or both NULL for a
// single request (batch 1) of max_qo_len queries and nnz_kv keys. v_scale multiplies o (in the
// epilogue's normalisation; the LSE does not depend on it).
FI_EXPORT int fi_prefill_sm90_ragged(const void* q, const void* k, const void* v, const void* qo_indptr,
                                     const void* kv_indptr, void* o, void* lse, int64_t nnz_q, int64_t nnz_kv,
                                     int64_t num_qo_heads, int64_t num_kv_heads, int64_t q_tok, int64_t q_head,
                                     int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head, int64_t o_tok,
                                     int64_t o_head, int64_t batch, int64_t max_qo_len, float sm_scale,
                                     float softcap, float v_scale, int64_t window_left, const void* mask,
                                     const void* mask_indptr, int64_t max_ctas, cudaStream_t stream) {
  using namespace fi_hopper;
  if (batch <= 0 || max_qo_len <= 0) return cudaSuccess;
  if (qo_indptr == nullptr && (kv_indptr != nullptr || batch != 1)) return cudaErrorInvalidValue;
  Params p{};
  const bool q_outer = num_qo_heads > 1 && q_head > q_tok;
  const bool kv_outer = num_kv_heads > 1 && k_head > k_tok;
  if ((num_kv_heads > 1 && (v_head > v_tok) != kv_outer) ||
      !encode_qkv(&p.tma_q, kQFormat, q, nnz_q, num_qo_heads, q_tok, q_head, kBlockM, q_outer) ||
      !encode_qkv(&p.tma_k, kKVFormat, k, nnz_kv, num_kv_heads, k_tok, k_head, kBlockN, kv_outer) ||
      !encode_qkv(&p.tma_v, kKVFormat, v, nnz_kv, num_kv_heads, v_tok, v_head, kBlockN, kv_outer))
    return cudaErrorInvalidValue;
  p.q_heads_outer = q_outer ? 1 : 0;
  p.kv_heads_outer = kv_outer ? 1 : 0;
  p.single_qo_len = int(max_qo_len);
  p.single_kv_len = int(nnz_kv);
  return launch(p, o, lse, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, o_tok, o_head, batch, max_qo_len,
                sm_scale, softcap, v_scale, window_left, mask, mask_indptr, max_ctas, stream);
}
#else
// Paged K/V: k/v are the halves of a cache with element strides (page, token, head), pages
// [num_pages] of page_size tokens; kv_indptr [batch + 1] indexes kv_indices (page ids),
// last_page_len [batch]. page_size must divide the KV tile (128 for d <= 128) and be a multiple of
// 8, or be a multiple of the tile (checked by the runner). The other arguments as in the ragged entry.
FI_EXPORT int fi_prefill_sm90_paged(const void* q, const void* k, const void* v, const void* qo_indptr,
                                    const void* kv_indptr, const void* kv_indices, const void* last_page_len,
                                    void* o, void* lse, int64_t nnz_q, int64_t num_pages, int64_t page_size,
                                    int64_t num_qo_heads, int64_t num_kv_heads, int64_t q_tok, int64_t q_head,
                                    int64_t k_page, int64_t k_tok, int64_t k_head, int64_t v_page, int64_t v_tok,
                                    int64_t v_head, int64_t o_tok, int64_t o_head, int64_t batch,
                                    int64_t max_qo_len, float sm_scale, float softcap, float v_scale,
                                    int64_t window_left, const void* mask, const void* mask_indptr,
                                    int64_t max_ctas, cudaStream_t stream) {
  using namespace fi_hopper;
  if (batch <= 0 || max_qo_len <= 0) return cudaSuccess;
  const bool tile_in_page = page_size % kBlockN == 0;
  const bool pages_in_tile = kBlockN % page_size == 0 && page_size % 8 == 0;
  if (qo_indptr == nullptr || kv_indptr == nullptr || kv_indices == nullptr || last_page_len == nullptr ||
      !(tile_in_page || pages_in_tile) || num_pages <= 0)
    return cudaErrorInvalidValue;
  Params p{};
  // Both halves of one cache share a layout; HND (head stride > token stride) swaps map dims 1, 2.
  const bool heads_outer = num_kv_heads > 1 && k_head > k_tok;
  const bool q_outer = num_qo_heads > 1 && q_head > q_tok;
  p.q_heads_outer = q_outer ? 1 : 0;
  if ((num_kv_heads > 1 && (v_head > v_tok) != heads_outer) ||
      !encode_qkv(&p.tma_q, kQFormat, q, nnz_q, num_qo_heads, q_tok, q_head, kBlockM, q_outer) ||
      !encode_paged(&p.tma_k, k, num_pages, page_size, num_kv_heads, k_page, k_tok, k_head, heads_outer) ||
      !encode_paged(&p.tma_v, v, num_pages, page_size, num_kv_heads, v_page, v_tok, v_head, heads_outer))
    return cudaErrorInvalidValue;
  p.heads_outer = heads_outer ? 1 : 0;
  p.kv_indices = static_cast<const int*>(kv_indices);
  p.last_page_len = static_cast<const int*>(last_page_len);
  p.page_size = int(page_size);
  return launch(p, o, lse, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, o_tok, o_head, batch, max_qo_len,
                sm_scale, softcap, v_scale, window_left, mask, mask_indptr, max_ctas, stream);
}
#endif
