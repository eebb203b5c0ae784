// Portable ("fa2") prefill attention for sm_80/86/89/90: FlashAttention-2 style, tensor cores via
// mma.sync.m16n8k16, K/V tiles streamed with cp.async into XOR-swizzled shared memory.
//
// The grid is persistent: CTA c runs work items work[work_indptr[c] .. work_indptr[c+1]) made by
// the host planner (plan.py), so a CUDA graph replays any later plan with the same grid. A work
// item is (request, kv head, first packed query row, kv range [kv_start, kv_end), partial slot).
// "Packed" rows fold
// the GQA group into the row dimension: packed row r of a request is query token r / G, qo head
// kv_head * G + r % G, so all G query heads that share a KV head reuse one K/V tile.
// Each warp owns 16 * MT packed rows; the softmax is online, in base 2, in registers. A work item
// whose request was split along KV (short queries over long KV) writes fp32 partial (o, lse) to
// the workspace; fi_prefill_fa2_merge combines them (same math as merge_states).
//
// Compile-time configuration (one instantiation per module, from spec.py):
//   FI_T (q/k/v/o element type), FI_D_QK, FI_D_VO, FI_NUM_WARPS, FI_M_TILES, FI_KV_TILE, FI_PAGED,
//   FI_CUSTOM_MASK,
//   FI_SOFTCAP, FI_ALIBI, FI_ROPE (Llama RoPE on Q/K tiles in shared memory), FI_KV_FP8 + FI_KV_T.
#include "fi/common.cuh"
#include "fi/fp8_widen.cuh"
#include "fi/mask_bits.cuh"
#include "fi/math.cuh"
#include "fi/mma.cuh"
#include "fi/pipeline.cuh"
#include "fi/vec.cuh"

#include <type_traits>

namespace {

using T = FI_T;
// K/V element type: T, or an fp8 type (FI_KV_FP8) that is staged raw and widened to T in
// shared memory before the mma (mma.sync has no mixed fp8 x 16-bit form).
#if FI_KV_FP8
using KVT = FI_KV_T;
#else
using KVT = T;
#endif
constexpr int DQK = FI_D_QK;
constexpr int DVO = FI_D_VO;
constexpr int NW = FI_NUM_WARPS;
constexpr int MT = FI_M_TILES;      // 16-row mma blocks per warp: K/V fragments are reused MT times
constexpr int NT = NW * 32;
constexpr int WARP_M = MT * 16;     // packed query rows per warp
constexpr int CTA_M = NW * WARP_M;  // packed query rows per CTA
constexpr int KN = FI_KV_TILE;      // kv tokens per tile (32 or 64)
static_assert(KN % 32 == 0, "kv tiles are whole 32-key mask windows");
constexpr int CQK = DQK * 2 / 16;   // 16-byte chunks per Q/K row
constexpr int CVO = DVO * 2 / 16;   // 16-byte chunks per V row
constexpr int RQK = DQK * (int)sizeof(KVT) / 16;  // 16-byte chunks per raw (global-format) K row
constexpr int RVO = DVO * (int)sizeof(KVT) / 16;
// Bytes of one pipeline stage: a raw K tile and a raw V tile.
constexpr int kStageBytes = KN * (DQK + DVO) * (int)sizeof(KVT);
static_assert(sizeof(T) == 2, "fa2 kernel takes 16-bit q/o");
static_assert(sizeof(KVT) == 2 || sizeof(KVT) == 1, "k/v are 16-bit or fp8");
static_assert(DQK % 64 == 0 && DVO % 64 == 0, "head dims must be multiples of 64 (swizzle, mma)");

// Host parameter block. The launcher receives it as two host arrays (int64 and double) whose
// order is IP_* / FP_* below; prefill/launch.py builds them from the same list (a CPU test
// checks that the two lists agree).
enum IntParam {
  IP_Q, IP_K, IP_V, IP_O, IP_LSE, IP_TMP_O, IP_TMP_LSE, IP_WORK,
  IP_QO_INDPTR, IP_KV_INDPTR, IP_KV_INDICES, IP_KV_LAST_PAGE_LEN, IP_MASK, IP_MASK_INDPTR,
  IP_ALIBI, IP_QO_LEN, IP_KV_LEN, IP_PAGE_SIZE,
  IP_Q_STRIDE_N, IP_Q_STRIDE_H, IP_K_STRIDE_P, IP_K_STRIDE_N, IP_K_STRIDE_H,
  IP_V_STRIDE_P, IP_V_STRIDE_N, IP_V_STRIDE_H, IP_O_STRIDE_N, IP_O_STRIDE_H,
  IP_NUM_QO_HEADS, IP_NUM_KV_HEADS, IP_CAUSAL, IP_WINDOW_LEFT, IP_WORK_INDPTR, IP_NUM_CTAS,
  IP_MERGE, IP_MERGE_COUNT, IP_NUM_MERGE_CTAS, IP_COUNT
};
enum FloatParam {
  FP_SCALE_LOG2, FP_SOFTCAP_PRE, FP_SOFTCAP_POST, FP_SM_SCALE, FP_ROPE_RCP_SCALE, FP_ROPE_LOG2_THETA,
  FP_OUT_SCALE, FP_COUNT
};

struct Params {
  const T* q; const KVT* k; const KVT* v; T* o; float* lse;
  float* tmp_o; float* tmp_lse;
  const int* work; const int* work_indptr;
  const int* merge; const int* merge_count;  // merge items and their number (device scalar)
  const int* qo_indptr; const int* kv_indptr; const int* kv_indices; const int* kv_last_page_len;
  const uint8_t* mask; const int* mask_indptr; const float* alibi;
  int qo_len, kv_len, page_size;                 // qo_len/kv_len used when indptrs are null
  int64_t q_sn, q_sh, k_sp, k_sn, k_sh, v_sp, v_sn, v_sh, o_sn, o_sh;
  int num_qo_heads, num_kv_heads, group, causal, window_left;
  float scale_log2;    // sm_scale * log2(e), no soft cap
  float softcap_pre;   // sm_scale / cap
  float softcap_post;  // cap * log2(e)
  float sm_scale;
  float rope_rcp_scale;  // 1 / rope_scale
  float rope_log2_theta; // log2(rope_theta)
  float out_scale;       // multiplies o (the caller's v_scale; 1: none), not the fp32 partials
};

// Work item: req, kv head, packed_row_start, kv_start, kv_end, partial slot (-1: write o directly).
constexpr int kWorkFields = 6;
// Merge item: req, kv head, packed_row_start, first slot, number of slots.
constexpr int kMergeFields = 5;

struct Request {
  int qo_start, qo_len, kv_len, kv_tok0;  // kv_tok0: first token (ragged) or first page slot (paged)
};

__device__ __forceinline__ Request request_of(const Params& p, int req) {
  Request r;
  if (p.qo_indptr != nullptr) {
    r.qo_start = p.qo_indptr[req];
    r.qo_len = p.qo_indptr[req + 1] - r.qo_start;
    const int a = p.kv_indptr[req], b = p.kv_indptr[req + 1];
    r.kv_tok0 = a;
#if FI_PAGED
    r.kv_len = b > a ? (b - a - 1) * p.page_size + p.kv_last_page_len[req] : 0;
#else
    r.kv_len = b - a;
#endif
  } else {
    r.qo_start = 0; r.qo_len = p.qo_len; r.kv_len = p.kv_len; r.kv_tok0 = 0;
  }
  return r;
}

// Address of kv token `pos` of the request, head `h` (row start).
__device__ __forceinline__ const KVT* kv_row(const KVT* base, int64_t sp, int64_t sn, int64_t sh,
                                           const Params& p, const Request& r, int pos, int h) {
#if FI_PAGED
  const int page = __ldg(p.kv_indices + r.kv_tok0 + pos / p.page_size);
  const int in_page = pos % p.page_size;
  return base + (int64_t)page * sp + (int64_t)in_page * sn + (int64_t)h * sh;
#else
  return base + (int64_t)(r.kv_tok0 + pos) * sn + (int64_t)h * sh;
#endif
}

// threadIdx.x read through volatile asm: the compiler cannot hoist it, so values derived from it
// are recomputed where used (a few integer ops) instead of being held in registers across the kv
// loop, where the fp32 accumulators need every register.
__device__ __forceinline__ int tid_remat() {
  int v;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(v));
  return v;
}

#if FI_PAGED
// Paged caches: the global addresses of a kv tile's KN rows (this item's head), for K (first KN)
// and V (next KN), live in shared memory, one buffer per tile parity, so the copies of a tile
// read one address per row instead of each dividing by the page size and loading the page table
// (a dependent global load in front of every cp.async, ~4x the issue slots of a contiguous copy).
// Threads i and i + KN own row i < KN (the first writes its K address, the second its V address,
// so the bookkeeping is spread over 2 KN threads: all four warps at KN = 64). A thread loads its
// row's page a tile before it writes the row's address (page_of_row for tile it + 3 during tile
// it, write_row_addresses for tile it + 2), so the page-table load's latency is hidden behind a
// tile of mma instead of stalling its warp.
static_assert(NT >= 2 * KN, "two threads per kv tile row (its K and its V address)");

__device__ __forceinline__ int page_of_row(const Params& p, const Request& r, int t0, int kv_hi) {
  const int pos = t0 + tid_remat() % KN;
  return tid_remat() < 2 * KN && pos < kv_hi ? __ldg(p.kv_indices + r.kv_tok0 + pos / p.page_size) : 0;
}

// Where row `row` of a tile sits in the address table of a copy with CH chunks per row: the rows
// one thread copies (row % RP, then every RP-th row) are adjacent, so it reads two per 16-byte load.
template <int CH>
__device__ __forceinline__ int row_slot(int row) {
  constexpr int RP = NT / CH;
  return (row % RP) * (KN / RP) + row / RP;
}

__device__ __forceinline__ void write_row_addresses(int64_t* dst, const Params& p, int t0, int page, int h) {
  const int i = tid_remat() % KN;
  // rows past kv_hi get page 0: a valid address that no copy reads (they are zero-filled)
  const int slot = (t0 + i) % p.page_size;
  if (tid_remat() < KN)
    dst[row_slot<RQK>(i)] = reinterpret_cast<int64_t>(
        p.k + ((int64_t)page * p.k_sp + (int64_t)slot * p.k_sn + (int64_t)h * p.k_sh));
  if (tid_remat() >= KN && tid_remat() < 2 * KN)
    dst[KN + row_slot<RVO>(i)] = reinterpret_cast<int64_t>(
        p.v + ((int64_t)page * p.v_sp + (int64_t)slot * p.v_sn + (int64_t)h * p.v_sh));
}
#endif

// Copy KN kv rows [t0, t0 + KN) of one head into smem (CH 16-byte chunks per row, XOR-swizzled
// when SWZ); rows >= kv_hi are zero-filled. Paged caches read the rows' addresses from `row_off`
// (write_row_addresses); the generic loop covers rows the fast loop's thread mapping does not fit
// (d = 192, which is ragged only).
template <int CH, bool SWZ = true>
__device__ __forceinline__ void load_kv_tile(uint32_t s_base, const KVT* g_base, int64_t sp,
                                             int64_t sn, int64_t sh, const Params& p,
                                             const Request& r, int t0, int kv_hi, int h,
                                             const int64_t* row_off) {
  if constexpr (NT % CH == 0 && KN % (NT / CH) == 0) {
    // Thread i always copies 16-byte column i % CH of rows i / CH + k * RP, so the shared-memory
    // offsets are compile-time constants plus a per-thread base; contiguous rows step one 64-bit
    // source pointer by RP rows (~5 instructions per copy, against ~20 for the generic loop
    // below: at d = 128 that is most of a tile's issue slots outside the mma), paged rows take
    // their address from shared memory (half a 16-byte load and an add of the column).
    constexpr int RP = NT / CH;
    const int tid = tid_remat();
    const int ch = tid % CH, r0 = tid / CH;
#if FI_PAGED
    // This thread's rows r0 + k * RP have adjacent addresses (row_slot): two per 16-byte load.
    static_assert((KN / RP) % 2 == 0, "paged row addresses are read in pairs");
    const longlong2* tab = reinterpret_cast<const longlong2*>(row_off + r0 * (KN / RP));
    // All of the thread's addresses are read before its first copy: a copy right after a
    // shared-memory load costs ptxas's three-slot guard, once per load-copy pair otherwise.
    longlong2 a[KN / RP / 2];
#pragma unroll
    for (int k = 0; k < KN / RP / 2; ++k) a[k] = tab[k];
#pragma unroll
    for (int k = 0; k < KN / RP; ++k) {
      const int row = r0 + k * RP;
      const bool ok = t0 + row < kv_hi;
      const KVT* src = reinterpret_cast<const KVT*>(k % 2 ? a[k / 2].y : a[k / 2].x);
      fi::cp_async_16(s_base + (row * CH + (SWZ ? fi::swizzle_chunk(row, ch) : ch)) * 16,
                      src + ch * (16 / (int)sizeof(KVT)), ok);
    }
#else
    const int64_t step = (int64_t)RP * sn;
    const KVT* src = g_base + (int64_t)(r.kv_tok0 + t0 + r0) * sn + (int64_t)h * sh + ch * (16 / (int)sizeof(KVT));
#pragma unroll
    for (int k = 0; k < KN / RP; ++k) {
      const int row = r0 + k * RP;
      const bool ok = t0 + row < kv_hi;
      fi::cp_async_16(s_base + (row * CH + (SWZ ? fi::swizzle_chunk(row, ch) : ch)) * 16, ok ? src : g_base, ok);
      src += step;
    }
#endif
    return;
  }
  // Not unrolled: an unrolled loop keeps every row's 64-bit source address live at once, and
  // those registers are what the mma accumulators need.
#pragma unroll 1
  for (int i = tid_remat(); i < KN * CH; i += NT) {
    const int row = i / CH, ch = i % CH;
    const int pos = t0 + row;
    const bool ok = pos < kv_hi;
    const KVT* src = ok ? kv_row(g_base, sp, sn, sh, p, r, pos, h) + ch * (16 / (int)sizeof(KVT)) : g_base;
    fi::cp_async_16(s_base + (row * CH + (SWZ ? fi::swizzle_chunk(row, ch) : ch)) * 16, src, ok);
  }
}

// Issue the copies of kv tile [t0, t0 + KN) into pipeline stage `stage` (global format).
// `row_off`: the tile's paged row addresses (K then V), unused for contiguous caches.
__device__ __forceinline__ void load_stage(uint32_t stage, const Params& p, const Request& r, int t0,
                                           int kv_hi, int h, const int64_t* row_off) {
  constexpr bool kSwz = !FI_KV_FP8;  // raw fp8 rows are only read row-linearly by the converter
  load_kv_tile<RQK, kSwz>(stage, p.k, p.k_sp, p.k_sn, p.k_sh, p, r, t0, kv_hi, h, row_off);
  load_kv_tile<RVO, kSwz>(stage + KN * DQK * (int)sizeof(KVT), p.v, p.v_sp, p.v_sn, p.v_sh, p, r, t0,
                          kv_hi, h, row_off + KN);
}

#if FI_KV_FP8
// Widen a raw fp8 tile (KN rows x RAW chunks of 16 elements, unswizzled) to T in the swizzled
// layout the mma fragments read (CH = 2 * RAW chunks of 8 elements per row); exact, and for bf16
// four integer / FMA-pipe instructions per pair (fi/fp8_widen.cuh) instead of fp32 round trips.
template <int RAW, int CH>
__device__ __forceinline__ void widen_tile(const uint8_t* raw, uint8_t* dst) {
#pragma unroll 1
  for (int i = threadIdx.x; i < KN * RAW; i += NT) {
    const int row = i / RAW, c = i % RAW;
    const uint4 v = *reinterpret_cast<const uint4*>(raw + (row * RAW + c) * 16);
    constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
    constexpr bool kE5m2 = std::is_same<KVT, __nv_fp8_e5m2>::value;
    const uint4 lo = fi::widen_fp8x8<kBf16, kE5m2>(v.x, v.y), hi = fi::widen_fp8x8<kBf16, kE5m2>(v.z, v.w);
    *reinterpret_cast<uint4*>(dst + (row * CH + fi::swizzle_chunk(row, 2 * c)) * 16) = lo;
    *reinterpret_cast<uint4*>(dst + (row * CH + fi::swizzle_chunk(row, 2 * c + 1)) * 16) = hi;
  }
}
#endif

#if FI_ROPE
// Llama RoPE (non-interleaved halves) applied in place to `rows` rows of a swizzled Q/K tile in
// shared memory: element i < D/2 pairs with i + D/2, angle = pos / (rope_scale * theta^(2i/D)).
// The rotated values are rounded to T, as if the caller had rotated q/k before the kernel.
template <typename PosFn>
__device__ __forceinline__ void rope_tile(uint8_t* tile, int rows, PosFn pos_of, const Params& p) {
  constexpr int HALF = CQK / 2;  // 16-byte chunk pairs per row
#pragma unroll 1
  for (int i = threadIdx.x; i < rows * HALF; i += NT) {
    const int row = i / HALF, c = i % HALF;
    uint4* pa = reinterpret_cast<uint4*>(tile + (row * CQK + fi::swizzle_chunk(row, c)) * 16);
    uint4* pb = reinterpret_cast<uint4*>(tile + (row * CQK + fi::swizzle_chunk(row, c + HALF)) * 16);
    uint4 va = *pa, vb = *pb;
    T* a = reinterpret_cast<T*>(&va);
    T* b = reinterpret_cast<T*>(&vb);
    const float pos = (float)pos_of(row);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int d = c * 8 + e;
      const float inv_freq = exp2f(-(2.f * d / DQK) * p.rope_log2_theta) * p.rope_rcp_scale;
      float sn, cs;
      sincosf(pos * inv_freq, &sn, &cs);
      const float x1 = fi::to_float(a[e]), x2 = fi::to_float(b[e]);
      a[e] = fi::from_float<T>(x1 * cs - x2 * sn);
      b[e] = fi::from_float<T>(x2 * cs + x1 * sn);
    }
    *pa = va;
    *pb = vb;
  }
}
#endif

// Shared memory: Q tile, 2 K/V stages, (fp8 KV) the widened tile, 4 item scalars, (paged) two
// tiles' row addresses.
constexpr int kInfoOffset = CTA_M * DQK * 2 + 2 * kStageBytes + (FI_KV_FP8 ? KN * (DQK + DVO) * 2 : 0);
constexpr int kRowOffOffset = kInfoOffset + 16;
constexpr int kSmemBytes = kRowOffOffset + (FI_PAGED ? 2 * 2 * KN * (int)sizeof(int64_t) : 0);

__device__ __forceinline__ void attend_item(const Params& p, const int* w, uint8_t* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int req = w[0], kvh = w[1], row_start = w[2], slot = w[5];
  const Request r = request_of(p, req);
  const int G = p.group;
  const int off = r.kv_len - r.qo_len;  // causal diagonal offset (bottom-right alignment)

  // Shared memory: Q tile, two stages of (K tile, V tile) in global format, and (fp8 KV only)
  // the current tile widened to T.
  const uint32_t sQ = fi::smem_u32(smem);
  const uint32_t sKV = sQ + CTA_M * DQK * 2;
#if FI_KV_FP8
  const uint32_t sKw = sKV + 2 * kStageBytes;
  const uint32_t sVw = sKw + KN * DQK * 2;
#endif

  // kv range of this CTA: the work item's range, clipped by causality and the window.
  const int min_qi = row_start / G;
  const int max_qi = min((row_start + CTA_M - 1) / G, r.qo_len - 1);
  int kv_lo = w[3], kv_hi = min(w[4], r.kv_len);
  if (p.causal) kv_hi = min(kv_hi, max_qi + off + 1);
  if (p.window_left >= 0) kv_lo = max(kv_lo, min_qi + off - p.window_left);
  const int n_tiles = kv_hi > kv_lo ? (kv_hi - kv_lo + KN - 1) / KN : 0;

  // Q tile: packed rows -> (token, head); rows past the request are zero-filled.
  for (int i = tid_remat(); i < CTA_M * CQK; i += NT) {  // (not hoisted out of the item loop)
    const int row = i / CQK, ch = i % CQK;
    const int pr = row_start + row;
    const int qi = pr / G, hq = kvh * G + (pr - qi * G);
    const bool ok = qi < r.qo_len;
    const T* src = ok ? p.q + (int64_t)(r.qo_start + qi) * p.q_sn + (int64_t)hq * p.q_sh + ch * 8 : p.q;
    fi::cp_async_16(sQ + (row * CQK + fi::swizzle_chunk(row, ch)) * 16, src, ok);
  }
  int64_t* row_off = reinterpret_cast<int64_t*>(smem + kRowOffOffset);  // [tile parity][K, V][KN]
#if FI_PAGED
  // Addresses of tiles 0 and 1; later tiles' are written two tiles ahead inside the loop, from
  // pages loaded three tiles ahead.
  write_row_addresses(row_off, p, kv_lo, page_of_row(p, r, kv_lo, kv_hi), kvh);
  write_row_addresses(row_off + 2 * KN, p, kv_lo + KN, page_of_row(p, r, kv_lo + KN, kv_hi), kvh);
  int next_page = page_of_row(p, r, kv_lo + 2 * KN, kv_hi);
  __syncthreads();
#endif
  if (n_tiles > 0) load_stage(sKV, p, r, kv_lo, kv_hi, kvh, row_off);
  fi::cp_async_commit();

  // This thread's rows: (mt, h) -> packed row row_start + warp * WARP_M + mt * 16 + g + 8 h.
  // Their token index is recomputed where needed instead of held in registers (the
  // accumulators need every register).
  // Item scalars that the kv loop needs only once per tile live in shared memory (written by
  // thread 0, read after the loop's barrier): with d = 128, kv tiles of 64 and 32 rows per warp
  // the 200 accumulator registers leave no room for them (they would spill to local memory).
  // mask_above / mask_below: tiles starting above / below them need the per-element mask.
  int* s_info = reinterpret_cast<int*>(smem + kInfoOffset);
  if (threadIdx.x == 0) {
    s_info[0] = kv_hi;
    s_info[1] = min(kv_hi, p.causal ? min_qi + off + 1 : kv_hi) - KN;
    s_info[2] = p.window_left >= 0 ? max_qi + off - p.window_left : -1;  // tile starts are >= 0
    s_info[3] = off;
  }
#if FI_CUSTOM_MASK
  const uint8_t* mask = p.mask + (p.mask_indptr != nullptr ? p.mask_indptr[req] : 0);
  // The request's last mask byte + 1: fi::mask_windows32 reads aligned words only inside it.
  const uint8_t* mask_end = mask + (int64_t(r.qo_len) * r.kv_len + 7) / 8;
#endif

  float o[MT][DVO / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < DVO / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    m[mt][0] = m[mt][1] = fi::kNegInf;
    l[mt][0] = l[mt][1] = 0.f;
  }

  // Without soft cap / ALiBi the logits stay raw (x = q.k) and the base-2 scale is folded into the
  // exponent's FFMA: exp2(x * scale - m * scale). Otherwise x is already in base-2 units.
  const float kXScale = (FI_SOFTCAP || FI_ALIBI) ? 1.f : p.scale_log2;
  // ldmatrix addresses. Every fragment row r that a lane addresses has r % 8 == lane % 8, so the
  // swizzled chunk (2 ks + b) ^ (r % 8) of k-step ks equals 2 ks ^ x with a per-lane x: the byte
  // offset is row_off + (x * 16 ^ ks * 32). Only row_off and x * 16 are kept; they are laundered
  // each tile (empty asm) so the compiler recomputes the per-ks XORs (one LOP3 each) instead of
  // hoisting ~30 loop-invariant addresses into registers that the accumulators need.
  uint32_t q_row = (warp * WARP_M + (lane & 15)) * CQK * 16;
  uint32_t qv_x = ((lane >> 4) ^ (lane & 7)) * 16;  // Q (A operand) and V (.trans B operand)
  uint32_t k_row = (((lane >> 4) << 3) + (lane & 7)) * CQK * 16;
  uint32_t k_x = (((lane >> 3) & 1) ^ (lane & 7)) * 16;
  uint32_t v_row = (lane & 15) * CVO * 16;
  for (int it = 0; it < n_tiles; ++it) {
    asm volatile("" : "+r"(q_row), "+r"(qv_x), "+r"(k_row), "+r"(k_x), "+r"(v_row));
    const int t0 = kv_lo + it * KN;
    const uint32_t stage = sKV + (it & 1) * kStageBytes;
#if FI_KV_FP8
    const uint32_t sK = sKw, sV = sVw;
#else
    const uint32_t sK = stage, sV = stage + KN * DQK * 2;
#endif
    // Two-stage pipeline, one barrier per tile: tile `it` (issued one iteration ago) has landed,
    // and every warp has finished tile it-1, so its stage can take tile it+1 while this one is
    // being computed.
    fi::cp_async_wait<0>();
    __syncthreads();
    const int kv_hi = reinterpret_cast<volatile int*>(s_info)[0];  // (same value, from smem)
    if (it + 1 < n_tiles) {
      load_stage(sKV + ((it + 1) & 1) * kStageBytes, p, r, t0 + KN, kv_hi, kvh,
                 row_off + ((it + 1) & 1) * 2 * KN);
      fi::cp_async_commit();
    }
#if FI_PAGED
    // Tile it + 2's addresses go where tile it's were: every thread issued tile it's copies in
    // the previous iteration, before the barrier above; the next barrier publishes them.
    if (it + 2 < n_tiles) {
      write_row_addresses(row_off + (it & 1) * 2 * KN, p, t0 + 2 * KN, next_page, kvh);
      next_page = page_of_row(p, r, t0 + 3 * KN, kv_hi);
    }
#endif
#if FI_KV_FP8
    // The widened buffer is free: every warp passed the barrier above, so finished tile it-1.
    widen_tile<RQK, CQK>(smem + (stage - sQ), smem + (sK - sQ));
    widen_tile<RVO, CVO>(smem + (stage - sQ) + KN * DQK, smem + (sV - sQ));
#if FI_ROPE
    __syncthreads();  // RoPE pairs elements written by other threads' widening
#endif
#endif
#if FI_ROPE
    // Rotate this tile's K (and, on the first tile, Q) in shared memory.
    if (it == 0) {
      rope_tile(smem, CTA_M, [&](int row) { return (row_start + row) / G + off; }, p);
    }
    rope_tile(smem + (sK - sQ), KN, [&](int row) { return t0 + row; }, p);
#endif
#if FI_KV_FP8 || FI_ROPE
    __syncthreads();  // publish the widened / rotated tile
#endif

    // S = Q K^T (WARP_M x KN per warp); each K fragment feeds all MT row blocks.
    float s[MT][KN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < KN / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DQK / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        fi::ldmatrix_x4(a[mt], sQ + q_row + (qv_x ^ (ks * 32)) + mt * 16 * CQK * 16);
      }
#pragma unroll
      for (int np = 0; np < KN / 16; ++np) {
        uint32_t b[4];
        fi::ldmatrix_x4(b, sK + k_row + (k_x ^ (ks * 32)) + np * 16 * CQK * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          fi::mma_16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
          fi::mma_16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // Logits in base 2, masking, online softmax. Tiles strictly inside every row's visible
    // range (most of a long causal prefill) skip the per-element mask.
    const bool need_mask = FI_CUSTOM_MASK || t0 > reinterpret_cast<volatile int*>(s_info)[1] ||
                           t0 < reinterpret_cast<volatile int*>(s_info)[2];
    // Pass 1 (soft cap / ALiBi variants, or tiles that need the mask): transform and mask the
    // logits. Hoisted out of the max/exp pass so that unmasked tiles without a transform run
    // straight-line code (a per-element `if (need_mask)` becomes one branch per element).
    constexpr bool kTransform = FI_SOFTCAP || FI_ALIBI;
    if (kTransform || need_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int pr = row_start + warp * WARP_M + g + mt * 16 + 8 * h;
          const int qi = pr / G;
          const int diag = qi + reinterpret_cast<volatile int*>(s_info)[3];
#if FI_ALIBI
          const float alibi_slope = __ldg(p.alibi + kvh * G + (pr - qi * G)) * fi::kLog2e;
#endif
          // Visible keys of this row as column offsets c = nb * 8 + e relative to this thread's
          // first column t0 + 2t: lo_rel <= c < hi_rel (two compares per element).
          const int col0 = t0 + 2 * t;
          const int hi_rel = (p.causal ? min(kv_hi, diag + 1) : kv_hi) - col0;
          const int lo_rel = p.window_left >= 0 ? max(diag - p.window_left, t0) - col0 : -2 * t;
#if FI_CUSTOM_MASK
          // This row's mask bits for the thread's columns col0 + c, 32 per window, with the
          // visible range [lo_rel, hi_rel) folded in: one bit test per element. Rows past the
          // request (padding) keep every key in range.
          uint32_t mbits[KN / 32];
          if (qi < r.qo_len) {
            fi::mask_windows32(mask, mask_end, (int64_t)qi * r.kv_len, col0, r.kv_len, mbits);
          } else {
#pragma unroll
            for (int wi = 0; wi < KN / 32; ++wi) mbits[wi] = 0xffffffffu;
          }
          // The range cuts into the tile only at the request's (or the split chunk's) last key or
          // under a sliding window (lo_rel is <= 0 otherwise): elsewhere the fold is skipped.
          if (p.window_left >= 0 || hi_rel < KN) {
#pragma unroll
            for (int wi = 0; wi < KN / 32; ++wi) mbits[wi] &= fi::range_bits32(lo_rel - 32 * wi, hi_rel - 32 * wi);
          }
#endif
#pragma unroll
          for (int nb = 0; nb < KN / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float x = s[mt][nb][2 * h + e];
              const int kv = t0 + nb * 8 + 2 * t + e;
#if FI_SOFTCAP
              x = fi::tanh_approx(x * p.softcap_pre) * p.softcap_post;
#elif FI_ALIBI
              x *= p.scale_log2;
#endif
#if FI_ALIBI
              x += alibi_slope * (float)(kv - diag);
#endif
              if (!kTransform || need_mask) {
                const int c = nb * 8 + e;
#if FI_CUSTOM_MASK
                const bool keep = (mbits[c / 32] >> (c % 32)) & 1u;
#else
                const bool keep = c < hi_rel && c >= lo_rel;
#endif
                if (!keep) x = fi::kNegInf;
              }
              s[mt][nb][2 * h + e] = x;
            }
          }
        }
      }
    }
    // Pass 2: online softmax per row.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m[mt][h];
#pragma unroll
        for (int nb = 0; nb < KN / 8; ++nb) mx = fmaxf(mx, fmaxf(s[mt][nb][2 * h], s[mt][nb][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row with no visible key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        const float m_use = mx == fi::kNegInf ? 0.f : mx;
        const float m_old = m[mt][h];
        const float corr = fi::exp2_approx((m_old - m_use) * kXScale);
        const float m_sub = m_use * kXScale;
        m[mt][h] = mx;
        float rs = 0.f;
#pragma unroll
        for (int nb = 0; nb < KN / 8; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fi::exp2_approx(fmaf(s[mt][nb][2 * h + e], kXScale, -m_sub));
            s[mt][nb][2 * h + e] = pv;
            rs += pv;
          }
        }
        l[mt][h] = l[mt][h] * corr + rs;  // per-thread partial row sum; quad-reduced at the end
        // Past the first tiles of a long row the running max rarely moves: skip the DVO / 4
        // multiplies when no row of the warp changed (corr would be exactly 1; warp-uniform
        // branch).
        if (__any_sync(0xffffffffu, m_old != mx)) {
#pragma unroll
          for (int d = 0; d < DVO / 8; ++d) {
            o[mt][d][2 * h] *= corr;
            o[mt][d][2 * h + 1] *= corr;
          }
        }
      }
    }

    // O += P V: P's C-fragments are re-packed in registers as the A operand (no smem trip).
#pragma unroll
    for (int j = 0; j < KN / 16; ++j) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = fi::pack2<T>(s[mt][2 * j][0], s[mt][2 * j][1]);
        a[mt][1] = fi::pack2<T>(s[mt][2 * j][2], s[mt][2 * j][3]);
        a[mt][2] = fi::pack2<T>(s[mt][2 * j + 1][0], s[mt][2 * j + 1][1]);
        a[mt][3] = fi::pack2<T>(s[mt][2 * j + 1][2], s[mt][2 * j + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DVO / 16; ++dp) {
        uint32_t b[4];
        fi::ldmatrix_x4_trans(b, sV + v_row + (qv_x ^ (dp * 32)) + j * 16 * CVO * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          fi::mma_16816<T>(o[mt][2 * dp], a[mt], b[0], b[1]);
          fi::mma_16816<T>(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
  fi::cp_async_wait<0>();  // nothing may be in flight when the CTA moves on (empty ranges load Q only)

  // Epilogue: normalise (o times out_scale), write o (or the unscaled fp32 partial) and the base-2 LSE.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lt = l[mt][h];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const float inv = lt > 0.f ? (slot < 0 ? p.out_scale : 1.f) * (1.f / lt) : 0.f;
      const float lse = lt > 0.f ? m[mt][h] * kXScale + fi::log2_approx(lt) : fi::kNegInf;
      const int local = warp * WARP_M + mt * 16 + g + 8 * h;
      const int pr = row_start + local;
      const int qi = pr / G;
      if (slot < 0) {
        if (qi >= r.qo_len) continue;
        const int hq = kvh * G + (pr - qi * G);
        // lse first: stored after the o row it is held across 16 stores (and spilled at d = 128).
        if (p.lse != nullptr && t == 0) p.lse[(int64_t)(r.qo_start + qi) * p.num_qo_heads + hq] = lse;
        T* dst = p.o + (int64_t)(r.qo_start + qi) * p.o_sn + (int64_t)hq * p.o_sh + 2 * t;
#pragma unroll
        for (int d = 0; d < DVO / 8; ++d) {
          *reinterpret_cast<uint32_t*>(dst + d * 8) =
              fi::pack2<T>(o[mt][d][2 * h] * inv, o[mt][d][2 * h + 1] * inv);
        }
      } else {
        const int64_t base = (int64_t)slot * CTA_M + local;
        if (t == 0) p.tmp_lse[base] = lse;
        float* dst = p.tmp_o + base * DVO + 2 * t;
#pragma unroll
        for (int d = 0; d < DVO / 8; ++d) {
          *reinterpret_cast<float2*>(dst + d * 8) =
              make_float2(o[mt][d][2 * h] * inv, o[mt][d][2 * h + 1] * inv);
        }
      }
    }
  }
}

__global__ void __launch_bounds__(NT, 1) prefill_fa2_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int first = p.work_indptr[blockIdx.x], last = p.work_indptr[blockIdx.x + 1];
  for (int i = first; i < last; ++i) {
    // The previous item's last reads of shared memory must finish before this one refills it.
    __syncthreads();
    attend_item(p, p.work + i * kWorkFields, smem);
  }
}

// Combine split-KV partials: merge item = (req, packed_row_start, first slot, number of slots).
// o = sum_i o_i 2^(lse_i - lse), lse = log2(sum_i 2^lse_i) (merge_states' math, base 2).
constexpr int kMergeThreads = 128;

__global__ void __launch_bounds__(kMergeThreads) prefill_fa2_merge_kernel(const Params p) {
  const int count = *p.merge_count;
  for (int item = blockIdx.x; item < count; item += gridDim.x) {
  const int* w = p.merge + item * kMergeFields;
  const int req = w[0], kvh = w[1], row_start = w[2], slot0 = w[3], n = w[4];
  const Request r = request_of(p, req);
  const int G = p.group;
  for (int i = threadIdx.x; i < CTA_M * (DVO / 4); i += kMergeThreads) {
    const int local = i / (DVO / 4), c = (i % (DVO / 4)) * 4;
    const int pr = row_start + local, qi = pr / G;
    if (qi >= r.qo_len) continue;
    float mx = fi::kNegInf;
    for (int s = 0; s < n; ++s)
      mx = fmaxf(mx, p.tmp_lse[(int64_t)(slot0 + s) * CTA_M + local]);
    const float m_use = mx == fi::kNegInf ? 0.f : mx;
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, den = 0.f;
    for (int s = 0; s < n; ++s) {
      const int64_t base = (int64_t)(slot0 + s) * CTA_M + local;
      const float wgt = exp2f(p.tmp_lse[base] - m_use);
      const float4 v = *reinterpret_cast<const float4*>(p.tmp_o + base * DVO + c);
      acc[0] += wgt * v.x; acc[1] += wgt * v.y; acc[2] += wgt * v.z; acc[3] += wgt * v.w;
      den += wgt;
    }
    const float inv = den > 0.f ? p.out_scale * (1.f / den) : 0.f;
    const int hq = kvh * G + (pr - qi * G);
    T* dst = p.o + (int64_t)(r.qo_start + qi) * p.o_sn + (int64_t)hq * p.o_sh + c;
#pragma unroll
    for (int k = 0; k < 4; ++k) dst[k] = fi::from_float<T>(acc[k] * inv);
    if (c == 0 && p.lse != nullptr)
      p.lse[(int64_t)(r.qo_start + qi) * p.num_qo_heads + hq] = den > 0.f ? m_use + log2f(den) : fi::kNegInf;
  }
  }
}

Params make_params(const int64_t* ip, const double* fp) {
  Params p;
  p.q = reinterpret_cast<const T*>(ip[IP_Q]);
  p.k = reinterpret_cast<const KVT*>(ip[IP_K]);
  p.v = reinterpret_cast<const KVT*>(ip[IP_V]);
  p.o = reinterpret_cast<T*>(ip[IP_O]);
  p.lse = reinterpret_cast<float*>(ip[IP_LSE]);
  p.tmp_o = reinterpret_cast<float*>(ip[IP_TMP_O]);
  p.tmp_lse = reinterpret_cast<float*>(ip[IP_TMP_LSE]);
  p.work = reinterpret_cast<const int*>(ip[IP_WORK]);
  p.work_indptr = reinterpret_cast<const int*>(ip[IP_WORK_INDPTR]);
  p.merge = reinterpret_cast<const int*>(ip[IP_MERGE]);
  p.merge_count = reinterpret_cast<const int*>(ip[IP_MERGE_COUNT]);
  p.qo_indptr = reinterpret_cast<const int*>(ip[IP_QO_INDPTR]);
  p.kv_indptr = reinterpret_cast<const int*>(ip[IP_KV_INDPTR]);
  p.kv_indices = reinterpret_cast<const int*>(ip[IP_KV_INDICES]);
  p.kv_last_page_len = reinterpret_cast<const int*>(ip[IP_KV_LAST_PAGE_LEN]);
  p.mask = reinterpret_cast<const uint8_t*>(ip[IP_MASK]);
  p.mask_indptr = reinterpret_cast<const int*>(ip[IP_MASK_INDPTR]);
  p.alibi = reinterpret_cast<const float*>(ip[IP_ALIBI]);
  p.qo_len = (int)ip[IP_QO_LEN];
  p.kv_len = (int)ip[IP_KV_LEN];
  p.page_size = (int)ip[IP_PAGE_SIZE];
  p.q_sn = ip[IP_Q_STRIDE_N]; p.q_sh = ip[IP_Q_STRIDE_H];
  p.k_sp = ip[IP_K_STRIDE_P]; p.k_sn = ip[IP_K_STRIDE_N]; p.k_sh = ip[IP_K_STRIDE_H];
  p.v_sp = ip[IP_V_STRIDE_P]; p.v_sn = ip[IP_V_STRIDE_N]; p.v_sh = ip[IP_V_STRIDE_H];
  p.o_sn = ip[IP_O_STRIDE_N]; p.o_sh = ip[IP_O_STRIDE_H];
  p.num_qo_heads = (int)ip[IP_NUM_QO_HEADS];
  p.num_kv_heads = (int)ip[IP_NUM_KV_HEADS];
  p.group = p.num_qo_heads / p.num_kv_heads;
  p.causal = (int)ip[IP_CAUSAL];
  p.window_left = (int)ip[IP_WINDOW_LEFT];
  p.scale_log2 = (float)fp[FP_SCALE_LOG2];
  p.softcap_pre = (float)fp[FP_SOFTCAP_PRE];
  p.softcap_post = (float)fp[FP_SOFTCAP_POST];
  p.sm_scale = (float)fp[FP_SM_SCALE];
  p.rope_rcp_scale = (float)fp[FP_ROPE_RCP_SCALE];
  p.rope_log2_theta = (float)fp[FP_ROPE_LOG2_THETA];
  p.out_scale = (float)fp[FP_OUT_SCALE];
  return p;
}

}  // namespace


// Runs the attention work list and then (if any item was split) the merge. `ip`/`fp` are host
// arrays laid out as IntParam / FloatParam. Reads them at call time, so CUDA-graph capture
// records the values (the device buffers they point at may change between replays).
FI_EXPORT int fi_prefill_fa2(const int64_t* ip, const double* fp, cudaStream_t stream) {
  const Params p = make_params(ip, fp);
  const int num_ctas = (int)ip[IP_NUM_CTAS], num_merge_ctas = (int)ip[IP_NUM_MERGE_CTAS];
  if (num_ctas > 0) {
    FI_TRY(fi::set_max_dynamic_smem(prefill_fa2_kernel, kSmemBytes));
    prefill_fa2_kernel<<<(unsigned)num_ctas, NT, kSmemBytes, stream>>>(p);
    FI_TRY(cudaGetLastError());
  }
  if (num_merge_ctas > 0) {
    prefill_fa2_merge_kernel<<<(unsigned)num_merge_ctas, kMergeThreads, 0, stream>>>(p);
  }
  return FI_LAUNCH_STATUS();
}

// Resident CTAs per SM of the attention kernel and its CTA rows, for the planner: out[0], out[1].
FI_EXPORT int fi_prefill_fa2_info(int* out) {
  FI_TRY(fi::set_max_dynamic_smem(prefill_fa2_kernel, kSmemBytes));
  int blocks = 0;
  FI_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, prefill_fa2_kernel, NT, kSmemBytes));
  out[0] = blocks;
  out[1] = CTA_M;
  return cudaSuccess;
}
