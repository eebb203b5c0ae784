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
#include <type_traits>

#include "fi/common.cuh"
#include "fi/math.cuh"
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
// Memory-parallelism variant (a tuning define; the decode bench routine's option mma_variant=N
// builds a module with another value for A/B runs on the GPU):
//   0  one 16-token tile (two for fp8) per warp iteration, loads issued before any use;
//   1  as 0, and each warp asks L2 for its next iteration's K/V rows (one bulk prefetch per lane,
//      no registers) before computing the current one, so the next loads hit L2;
//   2  two tiles per iteration for 16-bit caches too, at 2 CTAs per SM (the registers of 2 tiles).
#ifndef FI_MMA_VARIANT
#define FI_MMA_VARIANT 0
#endif
constexpr int VARIANT = FI_MMA_VARIANT;
static_assert(VARIANT >= 0 && VARIANT <= 2, "FI_MMA_VARIANT is 0, 1 or 2");
constexpr int NW = 4;
constexpr int KD = D / 4;       // K elements per lane per token
constexpr int VD = D / 8;       // V elements per lane per token (= PV n-tiles)
constexpr int KSTEPS = D / 16;
constexpr int KBYTES = KD * int(sizeof(KVT));
constexpr int TILES = (KV8 || VARIANT == 2) ? 2 : 1;
constexpr int CTAS_PER_SM = (!KV8 && VARIANT == 2) ? 2 : 3;
constexpr int VBYTES = VD * int(sizeof(KVT));
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

using Params = fi_attn::DecodeParams<QT, KVT>;

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
};

// Raw cache words -> pairs of MT elements (element 2i in the low half of word i).
template <int N>
__device__ __forceinline__ void to_pairs(const Raw<N * int(sizeof(KVT))>& r, uint32_t (&out)[N / 2]) {
  if constexpr (!KV8) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) out[i] = r.w[i];
  } else if constexpr (std::is_same_v<KVT, __nv_fp8_e5m2>) {
    // e5m2 is the high byte of an f16 (same exponent bias, mantissa cut to 2 bits): one byte
    // permute per pair, exact for every value, no conversion unit (sm_80 has no fp8 cvt).
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      out[2 * i] = __byte_perm(r.w[i], 0u, 0x1404u);      // bytes {0, b0, 0, b1}
      out[2 * i + 1] = __byte_perm(r.w[i], 0u, 0x3424u);  // bytes {0, b2, 0, b3}
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {  // cvt.rn.f16x2.e4m3x2: one instruction per pair on sm_89+
      const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(r.w[i] & 0xffffu), __NV_E4M3);
      const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(r.w[i] >> 16), __NV_E4M3);
      out[2 * i] = uint32_t(lo.x) | (uint32_t(lo.y) << 16);
      out[2 * i + 1] = uint32_t(hi.x) | (uint32_t(hi.y) << 16);
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

// 3 CTAs (12 warps) per SM keep enough 16-byte loads in flight; the kernel needs <= 168 registers.
__global__ void __launch_bounds__(NW * 32, CTAS_PER_SM) decode_mma_kernel(const Params p) {
  // 1-D grid, the item's (kv head, head subgroup) units adjacent: in CUDA-graph mode the grid
  // covers the capacity and the idle items past num_work come last, after all real work.
  const int nunits = (p.hq / p.group) * p.nsub;
  const int item = int(blockIdx.x) / nunits;
  const int unit = int(blockIdx.x) - item * nunits;
  if (item >= *p.num_work) return;  // CUDA-graph mode launches the capacity
  const int kvh = unit / p.nsub;
  const int qh0 = kvh * p.group + (unit % p.nsub) * GH;
  const int4 w = reinterpret_cast<const int4*>(p.work)[item];
  const int req = w.x, part = w.w;
  const int page_lo = p.indptr[req];
  const int npages = p.indptr[req + 1] - page_lo;
  const int kv_len = npages > 0 ? (npages - 1) * p.page_size + p.last_len[req] : 0;
  const int qpos = kv_len - 1;
  int lo = w.y;
  if (p.window_left >= 0) lo = max(lo, qpos - p.window_left);
  const int hi = min(w.z, kv_len);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;

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

  const KVT* kb = p.k + kvh * p.k_sh + c * PE;
  const KVT* vb = p.v + kvh * p.v_sh + g * VP;
  // 16-token tiles per warp iteration. Loads of all tiles are issued before any is used: a warp
  // has KD*2 + VD*4 cache elements per tile in flight; fp8 halves those bytes, so it takes two
  // tiles to keep ~8 KB per warp (~96 KB per SM at 3 CTAs) in flight, which HBM3e needs.
  for (int base0 = lo + warp * 16 * TILES; base0 < hi; base0 += NW * 16 * TILES) {
    // Rows past `hi` load the last valid row instead (no branch, no fault); their scores are
    // masked to -inf, so their probabilities are exactly 0.
    Raw<KBYTES> rk[TILES][2];
    Raw<VBYTES> rv[TILES][4];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
      const int base = base0 + 16 * tile;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        int off;
        const int64_t pid = fi_attn::page_of(p, page_lo, min(base + 8 * i + g, hi - 1), off);
        rk[tile][i].load(kb + pid * p.k_sp + off * p.k_st, 4 * PE);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        int off;
        const int t = base + 2 * c + (j & 1) + 8 * (j >> 1);
        const int64_t pid = fi_attn::page_of(p, page_lo, min(t, hi - 1), off);
        rv[tile][j].load(vb + pid * p.v_sp + off * p.v_st, 8 * VP);
      }
    }
    if constexpr (VARIANT == 1) {
      // Lane l: row (l & 15) of the warp's next tile, K for l < 16 and V for the rest.
      const int nb = base0 + NW * 16 * TILES;
      if (nb < hi) {
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
          const int t = nb + 16 * tile + (lane & 15);
          if (t < hi) {
            int off;
            const int64_t pid = fi_attn::page_of(p, page_lo, t, off);
            const KVT* row = lane < 16 ? p.k + kvh * p.k_sh + pid * p.k_sp + off * p.k_st
                                       : p.v + kvh * p.v_sh + pid * p.v_sp + off * p.v_st;
            fi_attn::prefetch_l2<D * int(sizeof(KVT))>(row);
          }
        }
      }
    }
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
  fi_attn::launch_dependents();  // no more K/V to stream: the merge grid may start launching
  l += __shfl_xor_sync(fi::kFullMask, l, 1);
  l += __shfl_xor_sync(fi::kFullMask, l, 2);

  // Merge the NW warp states through shared memory.
  __shared__ __align__(16) float sm_o[NW][GH][D];
  __shared__ float sm_m[NW][GH], sm_l[NW][GH];
#pragma unroll
  for (int i = 0; i < MTILES; ++i) {
    const int d = v_dim(g, 2 * i);  // rows g, g + 8 of m-tile i: local V elements 2i, 2i + 1
    if (2 * c < GH) { sm_o[warp][2 * c][d] = o[i][0]; sm_o[warp][2 * c][d + 1] = o[i][2]; }
    if (2 * c + 1 < GH) { sm_o[warp][2 * c + 1][d] = o[i][1]; sm_o[warp][2 * c + 1][d + 1] = o[i][3]; }
  }
  if (g < GH && c == 0) { sm_m[warp][g] = m; sm_l[warp][g] = l; }
  __syncthreads();
  for (int e = threadIdx.x; e < GH * D; e += NW * 32) {
    const int gg = e / D, d = e % D;
    float mx = fi::kNegInf;
#pragma unroll
    for (int r = 0; r < NW; ++r) mx = fmaxf(mx, sm_m[r][gg]);
    float lsum = 0.f, acc = 0.f;
    if (mx != fi::kNegInf) {
#pragma unroll
      for (int r = 0; r < NW; ++r) {
        const float wr = fi::exp2_approx(sm_m[r][gg] - mx);
        lsum += sm_l[r][gg] * wr;
        acc += sm_o[r][gg][d] * wr;
      }
    }
    const float val = lsum > 0.f ? acc * p.v_scale / lsum : 0.f;
    const float lse = lsum > 0.f ? mx + __log2f(lsum) : fi::kNegInf;
    const int h = qh0 + gg;
    if (part < 0) {
      p.out[req * p.o_sb + h * p.o_sh + d] = fi::from_float<QT>(val);
      if (p.lse != nullptr && d == 0) p.lse[int64_t(req) * p.hq + h] = lse;
    } else {
      p.part_o[(int64_t(part) * p.hq + h) * D + d] = val;
      if (d == 0) p.part_lse[int64_t(part) * p.hq + h] = lse;
    }
  }
}

}  // namespace

FI_EXPORT int fi_batch_decode(const DecodeArgs* a, cudaStream_t stream) {
  const Params p = fi_attn::make_params<QT, KVT>(a, SOFTCAP, GH);
  if (a->grid_items > 0) {
    const unsigned grid = unsigned(a->grid_items * a->num_kv_heads * p.nsub);
    decode_mma_kernel<<<grid, NW * 32, 0, stream>>>(p);
    FI_TRY(cudaGetLastError());
  }
  if (a->merge_batch > 0) {
    const cudaError_t err = fi_attn::launch_merge_partials<QT, D>(
        p.part_o, p.part_lse, reinterpret_cast<const int*>(a->merge_indptr), int(a->merge_batch),
        p.hq, p.out, p.o_sb, p.o_sh, p.lse, stream);
    FI_TRY(err);
  }
  return FI_LAUNCH_STATUS();
}

FI_EXPORT int fi_batch_decode_occupancy(int* blocks_per_sm) {
  return int(cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, decode_mma_kernel, NW * 32, 0));
}
