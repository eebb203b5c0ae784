// Pieces of the decode kernels that are not specific to one tile shape: raw K/V row loads and
// their conversion to float, ALiBi slopes, and the kernel that merges split-KV partial states.
// Including it also exports the host-side split-KV planner (decode_planner.h) from every module.
#pragma once
#include <cuda_fp8.h>

#include "fi/common.cuh"
#include "fi/math.cuh"
#include "fi/reduce.cuh"
#include "fi/vec.cuh"

#include "decode_args.h"
#include "decode_planner.h"

namespace fi_attn {

// Eight cache elements as one register word group: 16 bytes for 16-bit types, 8 for fp8.
template <typename T> struct RawVec { using type = uint4; };
template <> struct RawVec<__nv_fp8_e4m3> { using type = uint2; };
template <> struct RawVec<__nv_fp8_e5m2> { using type = uint2; };

// KV rows are read exactly once: bypass L1 allocation (ld.global.nc.L1::no_allocate).
template <typename R>
__device__ __forceinline__ R ldg_stream(const void* ptr);
template <>
__device__ __forceinline__ uint4 ldg_stream<uint4>(const void* ptr) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr));
  return r;
}
template <>
__device__ __forceinline__ uint2 ldg_stream<uint2>(const void* ptr) {
  uint2 r;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(r.x), "=r"(r.y) : "l"(ptr));
  return r;
}

template <typename T> __device__ __forceinline__ void convert(const typename RawVec<T>::type& r, float (&f)[8]);

template <>
__device__ __forceinline__ void convert<__nv_bfloat16>(const uint4& r, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // bf16 -> f32 is a 16-bit shift: no conversion instruction
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void convert<__half>(const uint4& r, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
template <__nv_fp8_interpretation_t KIND>
__device__ __forceinline__ void convert_fp8(const uint2& r, float (&f)[8]) {
  const uint32_t w[2] = {r.x, r.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // fp8x2 -> half2 in one cvt, then half2 -> float2
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * j)), KIND);
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&h));
      f[4 * i + 2 * j] = v.x;
      f[4 * i + 2 * j + 1] = v.y;
    }
  }
}
template <>
__device__ __forceinline__ void convert<__nv_fp8_e4m3>(const uint2& r, float (&f)[8]) { convert_fp8<__NV_E4M3>(r, f); }
template <>
__device__ __forceinline__ void convert<__nv_fp8_e5m2>(const uint2& r, float (&f)[8]) { convert_fp8<__NV_E5M2>(r, f); }

// ALiBi slope of head h of H (FlashInfer / the ALiBi paper): with n = 2^floor(log2 H), heads
// below n get 2^(-8 (h + 1) / n), the others 2^(-4 (2 (h - n) + 1) / n).
__device__ __forceinline__ float alibi_slope(int h, int num_heads) {
  int n = 1;
  while (n * 2 <= num_heads) n *= 2;
  return h < n ? exp2f(-8.0f * (h + 1) / n) : exp2f(-4.0f * (2 * (h - n) + 1) / n);
}


// Split requests are merged inside the decode grid (see merge_in_grid) when plan() provided the
// arrival counters; FI_GRID_MERGE=0 builds launch the merge kernel instead (for A/B timing).
#ifndef FI_GRID_MERGE
#define FI_GRID_MERGE 1
#endif
#ifndef FI_DECODE_SPREAD
#define FI_DECODE_SPREAD 1  // see launch_batch_decode
#endif
// Spread mode (decode_work) exists on sm_90+, where PDL launches place a step's CTAs into the slots
// the previous step left free. Below, the word plan() writes is ignored and the capacity grid runs
// its items by blockIdx (the same results): the unit loop would make sm_80's register-tile kernel
// spill (28 bytes at its 168-register bound).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FI_DECODE_SPREAD_MODE 0
#else
#define FI_DECODE_SPREAD_MODE 1
#endif
#ifndef FI_DECODE_SPREAD_CLAIMS
#define FI_DECODE_SPREAD_CLAIMS 1  // 0 (tests): no SM claims in spread mode, the sweeper runs every unit
#endif
inline bool grid_merge(const DecodeArgs* a) {
  return FI_GRID_MERGE && (a->flags & kDecodeGridMerge) && a->merge_count != 0;
}

// Kernel-side arguments, built once per launch from the host DecodeArgs block.
template <typename QT, typename KVT>
struct DecodeParams {
  const QT* q; int64_t q_sb, q_sh;
  const KVT* k; int64_t k_sp, k_st, k_sh;
  const KVT* v; int64_t v_sp, v_st, v_sh;
  const int* indptr; const int* indices; const int* last_len;
  const int* work; const int* num_work;
  QT* out; int64_t o_sb, o_sh; float* lse;
  float* part_o; float* part_lse;
  const int* merge_indptr;  // partial slots per request
  int* merge_count;         // arrivals per (request, head) for the in-grid merge; null: merge kernel
  unsigned long long* sched;  // spread-mode queue of a CUDA-graph wrapper (see decode_work); null: none
  int hq, group, nsub, page_size, page_shift, window_left;
  float q_mul;       // sm_scale * k_scale * (softcap ? 1/cap : log2 e)
  float cap_mul;     // cap * log2 e
  float v_scale;
  float rope_rcp_scale, rope_log2_theta;
  int early;         // kDecodeTablesEarly | kDecodeIndicesEarly bits of DecodeArgs::flags
};

template <typename QT, typename KVT>
inline DecodeParams<QT, KVT> make_params(const DecodeArgs* a, bool softcap, int gh) {
  DecodeParams<QT, KVT> p;
  p.q = reinterpret_cast<const QT*>(a->q); p.q_sb = a->q_stride_b; p.q_sh = a->q_stride_h;
  p.k = reinterpret_cast<const KVT*>(a->k);
  p.k_sp = a->k_stride_page; p.k_st = a->k_stride_tok; p.k_sh = a->k_stride_head;
  p.v = reinterpret_cast<const KVT*>(a->v);
  p.v_sp = a->v_stride_page; p.v_st = a->v_stride_tok; p.v_sh = a->v_stride_head;
  p.indptr = reinterpret_cast<const int*>(a->kv_indptr);
  p.indices = reinterpret_cast<const int*>(a->kv_indices);
  p.last_len = reinterpret_cast<const int*>(a->kv_last_page_len);
  p.work = reinterpret_cast<const int*>(a->work);
  p.num_work = reinterpret_cast<const int*>(a->num_work);
  p.out = reinterpret_cast<QT*>(a->out); p.o_sb = a->o_stride_b; p.o_sh = a->o_stride_h;
  p.lse = reinterpret_cast<float*>(a->lse);
  p.part_o = reinterpret_cast<float*>(a->part_o);
  p.part_lse = reinterpret_cast<float*>(a->part_lse);
  p.merge_indptr = reinterpret_cast<const int*>(a->merge_indptr);
  p.merge_count = grid_merge(a) ? reinterpret_cast<int*>(a->merge_count) : nullptr;
  p.sched = reinterpret_cast<unsigned long long*>(a->sched);
  p.hq = int(a->num_qo_heads);
  p.group = int(a->num_qo_heads / a->num_kv_heads);
  p.nsub = p.group / gh;
  p.page_size = int(a->page_size);
  p.page_shift = int(a->page_shift);
  p.window_left = int(a->window_left);
  const double log2e = 1.4426950408889634;
  const double scale = a->sm_scale * a->k_scale;
  p.q_mul = float(softcap ? scale / a->logits_soft_cap : scale * log2e);
  p.cap_mul = float(a->logits_soft_cap * log2e);
  p.v_scale = float(a->v_scale);
  p.rope_rcp_scale = float(1.0 / a->rope_scale);
  p.rope_log2_theta = float(log2(a->rope_theta));
  p.early = int(a->flags & (kDecodeTablesEarly | kDecodeIndicesEarly));
  return p;
}

// The last item's combine of one (head, float4 column): the n partial states at lo, MU slots per
// round with every slot's loads issued before any is used (one L2 round trip per round).
template <int MU, int D, typename P>
__device__ __forceinline__ void combine_slots(const P& p, int lo, int n, int h, int col, float& m, float& l,
                                              float (&acc)[4]) {
  const int64_t step = int64_t(p.hq) * (D / 4);  // float4s from one slot to the next
  const float* lse_p = p.part_lse + int64_t(lo) * p.hq + h;
  const float4* o_p = reinterpret_cast<const float4*>(p.part_o + (int64_t(lo) * p.hq + h) * D) + col;
  for (int s0 = 0; s0 < n; s0 += MU) {
    float w[MU];
    float4 v[MU];
#pragma unroll
    for (int k = 0; k < MU; ++k) {  // all loads first: MU independent L2 round trips overlap
      const int s = min(s0 + k, n - 1);
      w[k] = __ldcg(lse_p + int64_t(s) * p.hq);
      v[k] = __ldcg(o_p + s * step);
    }
#pragma unroll
    for (int k = 0; k < MU; ++k) w[k] = s0 + k < n ? w[k] : fi::kNegInf;  // clamped repeats weigh 0
    float mu = m;
#pragma unroll
    for (int k = 0; k < MU; ++k) mu = fmaxf(mu, w[k]);
    if (mu == fi::kNegInf) continue;  // no slot attended anything yet
    const float c = fi::exp2_approx(m - mu);  // 0 while m is -inf
    l *= c;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] *= c;
#pragma unroll
    for (int k = 0; k < MU; ++k) {
      const float pk = fi::exp2_approx(w[k] - mu);
      l += pk;
      acc[0] = fmaf(pk, v[k].x, acc[0]);
      acc[1] = fmaf(pk, v[k].y, acc[1]);
      acc[2] = fmaf(pk, v[k].z, acc[2]);
      acc[3] = fmaf(pk, v[k].w, acc[3]);
    }
    m = mu;
  }
}

// Split-KV without a second kernel: the items of a split request each write their partial state
// for heads qh0 .. qh0 + GH - 1 and then count themselves in merge_count[req * hq + qh0]; the one
// that arrives last combines the request's partials into out and lse. The count is one atomic of
// thread 0 with acquire-release order after a CTA barrier (the partial stores of every thread
// happen before it), and the last item reads the partials with ld.global.cg: other SMs wrote them
// and this SM's L1 may hold a stale line of part_lse. That item also puts the counter back to 0:
// no other item of this launch touches it again, and the next launch's items count only after
// griddepcontrol.wait (this grid has completed). plan() allocates the counters zeroed.
//
// Slots per load round of the last item's combine: requests split more than 8 ways take 16 at once
// (one L2 round trip for b1 x 32768's 16 partials instead of two), others 8 (no clamped repeats).
// A small gain, near the noise: tools/ab_decode.py in turns, H200, 16 against 8 for every request
// (decode_ab_session33_merge_mu.json): b1 x 32768 x1.007, b1 x 16384 x1.017, b2 x 4096 x1.000, b16
// x0.998, fp8 b128 (3 slots) x0.996; this form against 8 always, H100 (results/h100/
// decode_ab_session33_merge_mu_hybrid.json): b1 x1.009, b1 x 16384 x1.005, 8-slot requests (same
// code in both builds) x0.990-1.000. FI_MERGE_MU=8 builds take 8 always (A/B).
#ifndef FI_MERGE_MU
#define FI_MERGE_MU 16
#endif
constexpr int kWideRound = FI_MERGE_MU > 8 ? FI_MERGE_MU : 8;
template <typename QT, int D, int GH, int THREADS, typename P>
__device__ __forceinline__ void merge_in_grid(const P& p, int req, int qh0) {
  const int lo = p.merge_indptr[req], n = p.merge_indptr[req + 1] - lo;  // in flight across the barrier
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    int* cnt = p.merge_count + int64_t(req) * p.hq + qh0;
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(cnt) : "memory");
    last = before == n - 1;
    if (last) *cnt = 0;
  }
  if (!__syncthreads_or(last)) return;
  constexpr int Q = D / 4;  // float4 columns of a head
  for (int u = threadIdx.x; u < GH * Q; u += THREADS) {
    const int g = u / Q, col = u - g * Q, h = qh0 + g;
    float m = fi::kNegInf, l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (n > 8)  // uniform across the CTA
      combine_slots<kWideRound, D>(p, lo, n, h, col, m, l, acc);
    else
      combine_slots<8, D>(p, lo, n, h, col, m, l, acc);
    QT* dst = p.out + req * p.o_sb + h * p.o_sh + 4 * col;
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[e] = fi::from_float<QT>(l > 0.f ? acc[e] / l : 0.f);
    if (p.lse != nullptr && col == 0) p.lse[int64_t(req) * p.hq + h] = l > 0.f ? m + __log2f(l) : fi::kNegInf;
  }
}

// End of both decode kernels: combine the CTA's ROWS partial softmax states of each of its GH query
// heads (o, running max m, sum l, exchanged through shared memory by the caller) and write the
// normalised output and base-2 LSE, or the partial state of a split item (part >= 0). Every thread
// of the CTA (THREADS of them) calls this after the barrier that publishes the arrays.
template <typename QT, int D, int GH, int ROWS, int THREADS, typename P>
__device__ __forceinline__ void store_merged(const P& p, const float (&sm_o)[ROWS][GH][D],
                                             const float (&sm_m)[ROWS][GH], const float (&sm_l)[ROWS][GH],
                                             int req, int qh0, int part) {
  for (int e = threadIdx.x; e < GH * D; e += THREADS) {
    const int g = e / D, d = e % D;
    float mx = fi::kNegInf;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) mx = fmaxf(mx, sm_m[r][g]);
    float lsum = 0.f, acc = 0.f;
    if (mx != fi::kNegInf) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float w = fi::exp2_approx(sm_m[r][g] - mx);
        lsum += sm_l[r][g] * w;
        acc += sm_o[r][g][d] * w;
      }
    }
    const float val = lsum > 0.f ? acc * p.v_scale / lsum : 0.f;
    const float lse = lsum > 0.f ? mx + __log2f(lsum) : fi::kNegInf;
    const int h = qh0 + g;
    if (part < 0) {
      p.out[req * p.o_sb + h * p.o_sh + d] = fi::from_float<QT>(val);
      if (p.lse != nullptr && d == 0) p.lse[int64_t(req) * p.hq + h] = lse;
    } else {
      p.part_o[(int64_t(part) * p.hq + h) * D + d] = val;
      if (d == 0) p.part_lse[int64_t(part) * p.hq + h] = lse;
    }
  }
  if (part >= 0 && p.merge_count != nullptr) merge_in_grid<QT, D, GH, THREADS>(p, req, qh0);
}

// What a decode CTA works on. The grid is 1-D, the item's (kv head, head subgroup) units adjacent:
// in CUDA-graph mode it covers the capacity and the idle items past num_work come last, after all
// real work. [lo, hi) is the CTA's token range after the sliding window; qpos the query position.
struct DecodeWork {
  int kvh, qh0, req, part, page_lo, qpos, lo, hi;
  int item, unit;  // the work item and kv unit (a chain of pieces continues at item + 1)
  bool next;       // the item has kPieceNext
};

// Piece chains (plans of balanced pieces, planner.py's plan_pieces; sm_90+, see
// FI_DECODE_SPREAD_MODE): such a plan cuts the batch's tokens into equal shares, one per CTA of a
// wave, at request boundaries or inside requests, so one share can hold the end of one request and
// the start of the next (pieces). The work item's request word carries two flags: kPieceNext, the
// CTA that ran this item runs the next one after it (same kv unit); kPieceCont, this item is run by
// the previous item's CTA, and its own CTA exits at once. Each piece is an ordinary item: a request
// cut into several has a slot per piece and is merged as any split request. The flags are the
// planner's (decode_planner.h, which makes the plans).
using fi_decode_plan::kPieceCont;
using fi_decode_plan::kPieceNext;
constexpr int kPieceReq = kPieceCont - 1;

// Fills `d` from work item `w` (index `item`) for kv unit `unit` (kv head, head subgroup).
template <int GH, typename P>
__device__ __forceinline__ void fill_work(const P& p, DecodeWork& d, int4 w, int item, int unit) {
  d.item = item;
  d.unit = unit;
  d.next = FI_DECODE_SPREAD_MODE && (w.x & kPieceNext);
  d.kvh = unit / p.nsub;
  d.qh0 = d.kvh * p.group + (unit % p.nsub) * GH;
  d.req = FI_DECODE_SPREAD_MODE ? w.x & kPieceReq : w.x;
  d.part = w.w;
  d.page_lo = p.indptr[d.req];
  const int npages = p.indptr[d.req + 1] - d.page_lo;
  const int kv_len = npages > 0 ? (npages - 1) * p.page_size + p.last_len[d.req] : 0;
  d.qpos = kv_len - 1;
  d.lo = w.y;
  if (p.window_left >= 0) d.lo = max(d.lo, d.qpos - p.window_left);
  d.hi = min(w.z, kv_len);
}

// Spread mode: how a CUDA-graph wrapper's capacity grid runs a plan of at most one CTA per SM.
// Such a grid is mostly idle CTAs, and where the real ones land is the block scheduler's choice: a
// per-CTA trace of b1 x 32768 in a graph (decode_graph_trace_session18.json) found 35 SMs running two
// of its 128 real CTAs and 39 none, since under PDL a step's CTAs fill the slots the previous step
// left free. In spread mode (plan() sets it, num_work[1] = 1) the units are not tied to blockIdx:
// the first CTA of a launch on each SM takes the next unit from a queue, the others exit, so one
// CTA per SM does the work wherever the scheduler put them. The queue (p.sched, zeroed by plan()):
//   sched[0]      a ticket counter: the first 2 x SM-count CTAs of the grid (the same number every
//                 launch) take one each, so ticket / that number is the launch number e (a launch's
//                 CTAs all take theirs before the next launch starts: under PDL it starts once every
//                 CTA has triggered or exited, and each takes its ticket before either); the rest of
//                 the grid exits at once (one atomic each on one address slowed the churn of idle
//                 CTAs: x0.65-0.82 on decode steps of 8-12 us);
//   sched[1 + e % 2]  launch e's queue, (e << 32) + units taken: the atomicMax turns launch e - 2's
//                 queue into launch e's at 0 (launch e - 2 completed before launch e started: e - 1's
//                 CTAs trigger only after their griddepcontrol.wait);
//   sched[3 + sm] the last launch that claimed the SM.
// Every unit is taken exactly once whatever the placement: the CTA with a launch's last ticket (all
// others have theirs) takes units until the queue is empty and runs them one after the other (the
// sweeper); normally the per-SM CTAs have taken every unit by then.
constexpr unsigned kSpreadSms = 1024;  // claim slots (SM ids past it never claim: the sweeper covers)
struct Spread {
  unsigned long long epoch;  // spread mode: the launch number; 0: blockIdx picks the unit
  bool sweeper;              // this CTA takes units until none is left
};

__device__ __forceinline__ int take_unit(unsigned long long* sched, unsigned long long e, int total) {
  unsigned long long* q = sched + 1 + (e & 1);
  atomicMax(q, e << 32);  // same thread, same address: ordered before the add
  const int k = int(atomicAdd(q, 1ull) & 0xffffffffull);
  return k < total ? k : -1;
}

// Fills `d` for this CTA; false when it has nothing to do: an idle item (CUDA-graph capacity past
// num_work) or, in spread mode, a CTA that found its SM claimed. The work item is read before the
// num_work test (both loads in flight at once, not one after the other): the work buffer holds the
// whole grid's items, idle ones included.
// Under PDL (see DecodeFlag) the work item is read before the wait for the previous grid, and so
// are indptr and last_page_len when plan() wrote them; otherwise this waits before reading them.
// An idle CTA waits too, so that the grid never completes before its predecessor (a later PDL
// kernel's wait would then return early); in spread mode every CTA with a unit waits before it
// reads q and K/V, and some CTA always takes unit 0.
template <int GH, typename P>
__device__ __forceinline__ bool decode_work(const P& p, DecodeWork& d, Spread& sp) {
  const int nunits = (p.hq / p.group) * p.nsub;
  int item = int(blockIdx.x) / nunits;
  int unit = int(blockIdx.x) - item * nunits;
  int4 w = reinterpret_cast<const int4*>(p.work)[item];
  const int2 nw = *reinterpret_cast<const int2*>(p.num_work);  // num_work, spread mode
  sp.epoch = 0;
  sp.sweeper = false;
  if (FI_DECODE_SPREAD_MODE && nw.y != 0 && p.sched != nullptr) {
    __shared__ unsigned long long s_epoch;
    __shared__ int s_unit;
    const unsigned takers = min(gridDim.x, 2 * fi::sm_id_count());  // CTAs that take a ticket: the same every launch
    if (blockIdx.x >= takers) return false;           // no atomic for the idle rest of the grid
    if (threadIdx.x == 0) {
      const unsigned long long t = atomicAdd(p.sched, 1ull);
      const unsigned long long e = t / takers + 1, rank = t % takers;
      const int total = nw.x * nunits;
      const unsigned sm = fi::sm_id();
      int u = -1;
      if (FI_DECODE_SPREAD_CLAIMS && sm < kSpreadSms && atomicMax(p.sched + 3 + sm, e) < e)
        u = take_unit(p.sched, e, total);
      const bool sweeper = rank == takers - 1;
      if (u < 0 && sweeper) u = take_unit(p.sched, e, total);
      s_unit = u;
      s_epoch = sweeper ? e : 0;
    }
    __syncthreads();
    const int u = s_unit;
    sp.epoch = s_epoch;
    sp.sweeper = sp.epoch != 0;
    if (u < 0) return false;
    item = u / nunits;
    unit = u - item * nunits;
    w = reinterpret_cast<const int4*>(p.work)[item];
    if (!(p.early & kDecodeTablesEarly)) fi::grid_dependency_wait();
  } else {
    if (item >= nw.x || (FI_DECODE_SPREAD_MODE && (w.x & kPieceCont))) {  // idle, or a chain's later piece
      fi::grid_dependency_wait();
      return false;
    }
    if (!(p.early & kDecodeTablesEarly)) fi::grid_dependency_wait();
  }
  fill_work<GH>(p, d, w, item, unit);
  return true;
}

// The sweeper's next unit (spread mode): false when the queue is empty.
template <int GH, typename P>
__device__ __forceinline__ bool next_work(const P& p, DecodeWork& d, const Spread& sp) {
  __shared__ int s_next;
  const int nunits = (p.hq / p.group) * p.nsub;
  if (threadIdx.x == 0) s_next = take_unit(p.sched, sp.epoch, *p.num_work * nunits);
  __syncthreads();  // also: every thread is done with the previous unit's shared memory
  const int u = s_next;
  __syncthreads();  // s_next is rewritten by the next call
  if (u < 0) return false;
  const int item = u / nunits;
  fill_work<GH>(p, d, reinterpret_cast<const int4*>(p.work)[item], item, u - item * nunits);
  return true;
}

// The next piece of this CTA's chain (see kPieceNext): false at the chain's end.
template <int GH, typename P>
__device__ __forceinline__ bool next_piece(const P& p, DecodeWork& d) {
  if (!d.next) return false;
  __syncthreads();  // every thread is done with the previous piece's shared memory
  const int item = d.item + 1;
  fill_work<GH>(p, d, reinterpret_cast<const int4*>(p.work)[item], item, d.unit);
  return true;
}

// Page-table lookup of token t of a request whose pages start at indices[page_lo].
template <typename P>
__device__ __forceinline__ int64_t page_of(const P& p, int page_lo, int t, int& off) {
  int page;
  if (p.page_shift >= 0) { page = t >> p.page_shift; off = t & (p.page_size - 1); }
  else { page = t / p.page_size; off = t - page * p.page_size; }
  return p.indices[page_lo + page];
}

// Row of token t inside its page (the `off` of page_of).
template <typename P>
__device__ __forceinline__ int row_in_page(const P& p, int t) {
  return p.page_shift >= 0 ? (t & (p.page_size - 1)) : t - (t / p.page_size) * p.page_size;
}

// One CTA per (request, head): combines the request's partial states (base-2 LSE) into out.
// Requests whose slot range is empty were written directly by the decode kernel.
// The partials were just written, so they sit in L2: the cost is L2 round trips, not bandwidth.
// The 4 warps take the slots in turns of MU (warp w: slots w * MU.. of every 4 * MU), each in one
// pass with a running max (every slot's loads of a turn issued before any is used), and combine
// through shared memory: a request split up to 32 ways costs one round trip for its partials.
// The previous form (one warp per head, a max pass and a sum pass over the LSEs, then the slots
// MU at a time) took ceil(n / MU) + 2 round trips: b1 kv32768, 31 slots, ran 11.5 us under ncu.
template <typename OT, int D>
__global__ void __launch_bounds__(128) merge_partials_kernel(
    const float* __restrict__ part_o, const float* __restrict__ part_lse,
    const int* __restrict__ indptr, int hq, OT* out, int64_t o_sb, int64_t o_sh, float* lse) {
  constexpr int E = D / 32;  // 2, 4 or 8 contiguous floats per lane
  constexpr int MU = 8;
  constexpr int WARPS = 4;
  static_assert(E % 2 == 0, "float2 granularity");
  __shared__ float sm_m[WARPS], sm_l[WARPS];
  __shared__ float sm_o[WARPS][D];
  fi::grid_dependency_wait();  // launched early (PDL): the decode grid's partials are complete after this
  fi::launch_dependents();  // the next grid may launch (a PDL decode grid reads its plan meanwhile)
  const int b = blockIdx.x;
  const int h = blockIdx.y;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int lo = indptr[b], n = indptr[b + 1] - lo;
  if (n <= 0) return;  // uniform across the CTA
  const float* lse_p = part_lse + int64_t(lo) * hq + h;
  const float* o_p = part_o + (int64_t(lo) * hq + h) * D + lane * E;
  float m = fi::kNegInf, l = 0.f, acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  for (int s0 = warp * MU; s0 < n; s0 += WARPS * MU) {
    float w[MU];
    float2 v[MU][E / 2];
#pragma unroll
    for (int u = 0; u < MU; ++u) {  // all loads first: MU independent L2 round trips overlap
      const int s = min(s0 + u, n - 1);
      w[u] = lse_p[int64_t(s) * hq];
      const float2* src = reinterpret_cast<const float2*>(o_p + int64_t(s) * hq * D);
#pragma unroll
      for (int e = 0; e < E / 2; ++e) v[u][e] = src[e];
    }
    // A repeated (clamped) slot counts as exp2(-inf) = 0 (a select, not a branch, so the loads
    // above stay in one basic block and are all issued before the first use).
#pragma unroll
    for (int u = 0; u < MU; ++u) w[u] = s0 + u < n ? w[u] : fi::kNegInf;
    float mu = m;
#pragma unroll
    for (int u = 0; u < MU; ++u) mu = fmaxf(mu, w[u]);
    if (mu == fi::kNegInf) continue;  // nothing attended yet (warp-uniform)
    const float c = fi::exp2_approx(m - mu);  // 0 while m is still -inf
    l *= c;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= c;
#pragma unroll
    for (int u = 0; u < MU; ++u) {
      const float pu = fi::exp2_approx(w[u] - mu);
      l += pu;
#pragma unroll
      for (int e = 0; e < E / 2; ++e) {
        acc[2 * e] = fmaf(pu, v[u][e].x, acc[2 * e]);
        acc[2 * e + 1] = fmaf(pu, v[u][e].y, acc[2 * e + 1]);
      }
    }
    m = mu;
  }
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int e = 0; e < E; ++e) sm_o[warp][lane * E + e] = acc[e];
  __syncthreads();
  if (warp != 0) return;
  float mx = sm_m[0];
#pragma unroll
  for (int wp = 1; wp < WARPS; ++wp) mx = fmaxf(mx, sm_m[wp]);
  float sum = 0.f, o[E];
#pragma unroll
  for (int e = 0; e < E; ++e) o[e] = 0.f;
  if (mx != fi::kNegInf) {
#pragma unroll
    for (int wp = 0; wp < WARPS; ++wp) {
      const float c = fi::exp2_approx(sm_m[wp] - mx);  // 0 for a warp that saw no slot
      sum = fmaf(sm_l[wp], c, sum);
#pragma unroll
      for (int e = 0; e < E; ++e) o[e] = fmaf(sm_o[wp][lane * E + e], c, o[e]);
    }
  }
  OT* dst = out + b * o_sb + h * o_sh + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) dst[e] = fi::from_float<OT>(sum > 0.f ? o[e] / sum : 0.f);
  if (lse != nullptr && lane == 0) lse[int64_t(b) * hq + h] = sum > 0.f ? mx + __log2f(sum) : fi::kNegInf;
}

// The merge is launched with programmatic stream serialization (PDL, SM90+): its grid is set up
// while the decode kernel's last CTAs run instead of after it drains. The decode CTAs signal
// after their main loop; the merge waits (griddepcontrol.wait) for the whole decode grid to
// complete and flush before it reads a partial. Older GPUs launch it normally.
template <typename OT, int D>
inline cudaError_t launch_merge_partials(const float* part_o, const float* part_lse, const int* indptr,
                                         int batch, int hq, OT* out, int64_t o_sb, int64_t o_sh,
                                         float* lse, cudaStream_t stream) {
  const dim3 grid{unsigned(batch), unsigned(hq)};
  if (!fi::pdl_supported()) {
    merge_partials_kernel<OT, D><<<grid, 128, 0, stream>>>(part_o, part_lse, indptr, hq, out, o_sb, o_sh, lse);
    return cudaGetLastError();
  }
  return fi::launch_pdl(merge_partials_kernel<OT, D>, grid, dim3(128), 0, stream, part_o, part_lse, indptr, hq, out,
                        o_sb, o_sh, lse);
}

// plan() of a CUDA-graph wrapper: the page tables staged with the plan go from the metadata buffer
// into the wrapper's fixed table buffers, in stream order after the metadata upload. One small
// kernel does the three copies: three cudaMemcpyAsync calls cost more host time (H200 host,
// tools/probe_plan_dist.py --graph), and three copies from pageable host memory, which plan() made
// before, cost 2-3x more again.
struct TableCopies {
  int32_t* dst[3];
  const int32_t* src[3];
  int64_t n[3];  // int32 entries
};

__global__ void __launch_bounds__(256) copy_tables_kernel(const TableCopies c) {
  const int64_t total = c.n[0] + c.n[1] + c.n[2];
  for (int64_t i = int64_t(blockIdx.x) * 256 + threadIdx.x; i < total; i += int64_t(gridDim.x) * 256) {
    int64_t j = i;
    int32_t* d = c.dst[0];
    const int32_t* src = c.src[0];
    if (j >= c.n[0]) {  // selects, not an indexed parameter array (which would go through the stack)
      j -= c.n[0];
      d = c.dst[1];
      src = c.src[1];
      if (j >= c.n[1]) {
        j -= c.n[1];
        d = c.dst[2];
        src = c.src[2];
      }
    }
    d[j] = src[j];
  }
}

// Three (dst, src, bytes) copies between device buffers (bytes a multiple of 4, 4-byte aligned
// pointers; 0 bytes: skipped).
FI_EXPORT int fi_copy_tables(void* d0, const void* s0, int64_t n0, void* d1, const void* s1, int64_t n1, void* d2,
                             const void* s2, int64_t n2, cudaStream_t stream) {
  const TableCopies c{{static_cast<int32_t*>(d0), static_cast<int32_t*>(d1), static_cast<int32_t*>(d2)},
                      {static_cast<const int32_t*>(s0), static_cast<const int32_t*>(s1),
                       static_cast<const int32_t*>(s2)},
                      {n0 / 4, n1 / 4, n2 / 4}};
  const int64_t total = c.n[0] + c.n[1] + c.n[2];
  if (total <= 0) return 0;
  const unsigned blocks = unsigned(fi::ceil_div<int64_t>(total, 256) < 264 ? fi::ceil_div<int64_t>(total, 256) : 264);
  copy_tables_kernel<<<blocks, 256, 0, stream>>>(c);
  return FI_LAUNCH_STATUS();
}

// fi_batch_decode of either kernel: the decode grid (grid_items items x kv units), then the merge
// kernel when the plan split a request (merge_batch > 0) and the grid does not merge (grid_merge).
// With kDecodePdl on sm_90+ the decode grid is launched with PDL (see DecodeFlag): in a decode
// loop its CTAs launch and read their plan while the previous kernel (the previous step's decode
// grid, whose CTAs trigger after their main loop) finishes. tools/ab_decode.py in turns against
// launching after the previous kernel (H200, decode_ab_pdl_session16.json, with the merge kernel
// of the time): b1 x 32768 x1.037, b1 x 8192 x1.090, b16 x 8192 x1.015; b64 / b128 (unsplit) and
// fp8 b128 (a 536 us step) x0.997-1.000. The merge in the grid (session 17,
// decode_ab_grid_merge_session17.json): x1.01-1.04 on small split batches, x0.997-1.002 on b16 and fp8.
//
// A wrapper built without use_cuda_graph sets kDecodeRefuseCapture: its plan() buffers move with the
// next plan, so a launch into a stream being captured is refused (fi::refuse_capture) before
// anything is queued; run() turns the code into an InputError.
// FI_DECODE_CARVEOUT (A/B): the tensor-core decode kernel (dynamic shared memory) asks for the
// largest shared-memory carveout, so the CTAs per SM the planner counts on (batch_decode_occupancy)
// do not depend on the carveout the driver picks after other kernels. Adopted on a bench run where
// b1 read 37.47 us in the full routine against 40.4 before (session 23); session 34's phase probe
// puts the 40.4-us readings on the power cap's lowered SM clock right after the large rows, so that
// gain may have been timing. Not for the CUDA-core kernel (no dynamic shared memory): MHA b64 ran
// 1059 us with it against 933 (why not analysed). Once per kernel and device (fi::set_attribute_once).
#ifndef FI_DECODE_CARVEOUT
#define FI_DECODE_CARVEOUT 1
#endif
template <typename Kernel>
inline cudaError_t prefer_max_shared(Kernel kernel, int dev) {
  return FI_DECODE_CARVEOUT ? fi::prefer_max_shared_carveout(kernel, dev) : cudaSuccess;
}

template <typename QT, int D, typename Kernel, typename P>
inline int launch_batch_decode(const DecodeArgs* a, const P& p, Kernel kernel, int threads, int smem) {
  int dev = 0;
  FI_TRY(cudaGetDevice(&dev));
  if (a->device >= 0 && a->device != dev) {
    // The buffers sit on a GPU that is not the current one (a process driving several GPUs without
    // set_device): launch there and give the caller its device back. The device guard is here, not
    // in Python, because run()'s host time is counted in tenths of a microsecond and asking torch
    // for the current device costs about 0.3 us; cudaGetDevice above costs tens of nanoseconds.
    FI_TRY(cudaSetDevice(int(a->device)));
    const int rc = launch_batch_decode<QT, D>(a, p, kernel, threads, smem);
    const cudaError_t back = cudaSetDevice(dev);
    return rc ? rc : int(back);
  }
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(a->stream);
  if (a->flags & kDecodeRefuseCapture) FI_TRY(fi::refuse_capture(stream));
  if (a->grid_items > 0) {
    const unsigned grid = unsigned(a->grid_items * a->num_kv_heads * p.nsub);
    // A grid of at most one CTA per SM is launched so that no SM holds two (fi::one_cta_per_sm_smem):
    // a per-CTA trace of b1 x 32768 (128 CTAs, FI_DECODE_TRACE) had found 5 SMs with two CTAs and
    // 9 with none, b1 x 16384 54 with two and 58 idle. Plain wrappers in turns
    // (decode_spread_ab_final_session17.json): b1 x 32768 x1.21, b1 x 16384 x1.30, b4 x 8192
    // x1.21. A CUDA-graph wrapper's grid is its capacity (mostly idle CTAs) and is not affected:
    // its plans of at most one CTA per SM run in spread mode instead (see decode_work).
    // FI_DECODE_SPREAD=0 builds launch with the kernel's own size (for A/B).
    const int launch_smem = FI_DECODE_SPREAD ? fi::one_cta_per_sm_smem(grid, smem, dev) : smem;
    FI_TRY(fi::set_max_dynamic_smem(kernel, launch_smem, dev));
    if (smem > 0) FI_TRY(prefer_max_shared(kernel, dev));
    if ((a->flags & kDecodePdl) && fi::pdl_supported(dev)) {
      FI_TRY(fi::launch_pdl(kernel, dim3(grid), dim3(unsigned(threads)), size_t(launch_smem), stream, p));
    } else {
      kernel<<<grid, threads, launch_smem, stream>>>(p);
      FI_TRY(cudaGetLastError());
    }
  }
  if (a->merge_batch > 0 && !grid_merge(a)) {
    const cudaError_t err = launch_merge_partials<QT, D>(
        p.part_o, p.part_lse, reinterpret_cast<const int*>(a->merge_indptr), int(a->merge_batch), p.hq,
        p.out, p.o_sb, p.o_sh, p.lse, stream);
    FI_TRY(err);
  }
  return FI_LAUNCH_STATUS();
}

// Resident CTAs per SM of a decode kernel: the planner sizes split-KV chunks with it.
template <typename Kernel>
inline int batch_decode_occupancy(int* blocks_per_sm, Kernel kernel, int threads, int smem) {
  int dev = 0;
  FI_TRY(cudaGetDevice(&dev));
  FI_TRY(fi::set_max_dynamic_smem(kernel, smem, dev));
  if (smem > 0) FI_TRY(prefer_max_shared(kernel, dev));
  return int(cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kernel, threads, smem));
}

}  // namespace fi_attn
