// Batch decode attention over a paged KV cache (one query token per request), CUDA cores.
//
// Decode is HBM bound: each K/V element must be read exactly once at full bandwidth. One CTA
// owns (work item = request x token chunk, kv head, group of GH query heads) and processes every
// query head of its GQA group against each K/V row it loads, so a row is fetched once for all of
// them. A warp is split into RG row groups of TX lanes; a row group reads one 8-element slice
// per lane of a K and a V row (16-byte loads for 16-bit caches, 8-byte for fp8), U rows at a
// time so that many loads are in flight per thread (latency x bandwidth needs ~24 KB in flight
// per SM). Each row group keeps its own online-softmax state (base 2: log2(e) is folded into the
// query scale, so the hot loop uses ex2.approx); the states of all row groups are merged through
// shared memory at the end. Long requests are split into chunks by the host planner; a chunk
// writes a partial (o, lse) to the float workspace and the request's last chunk to finish combines
// them (merge_in_grid, decode_common.cuh).
//
// Compile-time: FI_Q (query/output type), FI_KV (cache type), FI_HEAD_DIM, FI_GH (query heads per
// CTA, divides the GQA group), FI_POS (0 none, 1 ROPE_LLAMA, 2 ALIBI), FI_SOFTCAP (0/1).
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

constexpr int VEC = 8;            // elements per lane per row
constexpr int TX = D / VEC;       // lanes per row: 8, 16, 32 for D = 64, 128, 256
constexpr int RG = 32 / TX;       // row groups per warp
constexpr int NW = 4;             // warps per CTA
constexpr int ROWS = NW * RG;     // independent softmax states per CTA
// Rows per row group per step: enough loads in flight, registers bounded by GH x 8 q/o values.
constexpr int U = GH <= 2 ? 8 : (GH <= 4 ? 4 : 2);
constexpr int TILE = ROWS * U;
static_assert(D % 64 == 0 && D <= 256, "head_dim must be 64, 128 or 256");
static_assert(GH >= 1 && GH <= 8, "1..8 query heads per CTA");

using Raw = typename fi_attn::RawVec<KVT>::type;

using Params = fi_attn::DecodeParams<QT, KVT>;

// Angle of rotary pair `i` (0 <= i < D/2) at position `pos`: pos / (scale * theta^(2i/D)).
__device__ __forceinline__ float rope_angle(const Params& p, int i, int pos) {
  const float inv_freq = p.rope_rcp_scale * exp2f(-p.rope_log2_theta * (2.0f * i / D));
  return float(pos) * inv_freq;
}

// One work unit (see decode_work): the CTA's KV range of one request and head group, merged into
// out (or its partial slot).
__device__ __forceinline__ void attend(const Params& p, const fi_attn::DecodeWork& wk) {
  const int kvh = wk.kvh, qh0 = wk.qh0, req = wk.req, part = wk.part;
  const int page_lo = wk.page_lo, qpos = wk.qpos, lo = wk.lo, hi = wk.hi;
  fi::grid_dependency_wait();  // PDL (DecodeFlag): q, K/V and out only after the previous grid

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tx = lane % TX, gr = warp * RG + lane / TX;
  const int d0 = tx * VEC;

  // Query slice of every head of the group, pre-scaled (and rotated at position kv_len - 1).
  float q[GH][VEC];
#pragma unroll
  for (int g = 0; g < GH; ++g) {
    const QT* qp = p.q + req * p.q_sb + (qh0 + g) * p.q_sh;
    fi::vec_t<QT, VEC> qv;
    qv.load(qp + d0);
    qv.to_float(q[g]);
    if constexpr (POS == 1) {
      fi::vec_t<QT, VEC> pv;
      const int pd = (d0 + D / 2) % D;  // partner slice of the rotate-half pairing
      pv.load(qp + pd);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        float s, c;
        sincosf(rope_angle(p, (d0 + i) % (D / 2), qpos), &s, &c);
        const float partner = fi::to_float(pv[i]);
        q[g][i] = d0 < D / 2 ? q[g][i] * c - partner * s : q[g][i] * c + partner * s;
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) q[g][i] *= p.q_mul;
  }
  float alibi[GH];
  if constexpr (POS == 2) {
#pragma unroll
    for (int g = 0; g < GH; ++g) alibi[g] = fi_attn::alibi_slope(qh0 + g, p.hq) * fi::kLog2e;
  }

  float m[GH], l[GH], o[GH][VEC];
#pragma unroll
  for (int g = 0; g < GH; ++g) {
    m[g] = fi::kNegInf;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[g][i] = 0.f;
  }

  const KVT* kbase = p.k + kvh * p.k_sh + d0;
  const KVT* vbase = p.v + kvh * p.v_sh + d0;
  for (int base = lo; base < hi; base += TILE) {
    const int t0 = base + gr * U;
    Raw kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = t0 + u;
      if (t < hi) {
        int page, off;
        if (p.page_shift >= 0) { page = t >> p.page_shift; off = t & (p.page_size - 1); }
        else { page = t / p.page_size; off = t - page * p.page_size; }
        const int64_t pid = p.indices[page_lo + page];
        kr[u] = fi_attn::ldg_stream<Raw>(kbase + pid * p.k_sp + off * p.k_st);
        vr[u] = fi_attn::ldg_stream<Raw>(vbase + pid * p.v_sp + off * p.v_st);
      } else {
        kr[u] = Raw{};  // zero: a masked row must not inject NaN through 0 * garbage
        vr[u] = Raw{};
      }
    }
    float s[GH][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[VEC];
      fi_attn::convert<KVT>(kr[u], kf);
      if constexpr (POS == 1) {
        const int t = t0 + u;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          // the partner element sits in the lane TX/2 away, in the same row group
          const float partner = __shfl_xor_sync(fi::kFullMask, kf[i], TX / 2);
          float sn, c;
          sincosf(rope_angle(p, (d0 + i) % (D / 2), t), &sn, &c);
          kf[i] = d0 < D / 2 ? kf[i] * c - partner * sn : kf[i] * c + partner * sn;
        }
      }
#pragma unroll
      for (int g = 0; g < GH; ++g) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc = fmaf(q[g][i], kf[i], acc);
        s[g][u] = acc;
      }
    }
    // Sum the dot products over the TX lanes of each row group (xor keeps every lane a copy).
#pragma unroll
    for (int off = TX / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int g = 0; g < GH; ++g)
#pragma unroll
        for (int u = 0; u < U; ++u) s[g][u] += __shfl_xor_sync(fi::kFullMask, s[g][u], off);
    }
#pragma unroll
    for (int g = 0; g < GH; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float x = s[g][u];
        // accurate tanh: tanh.approx's 2^-11 relative error, times the cap, would move the LSE
        if constexpr (SOFTCAP) x = p.cap_mul * tanhf(x);
        if constexpr (POS == 2) x += alibi[g] * float(t0 + u - qpos);
        x = (t0 + u < hi) ? x : fi::kNegInf;
        s[g][u] = x;
        mx = fmaxf(mx, x);
      }
      if (mx == fi::kNegInf) continue;  // nothing visible yet for this row group
      const float corr = fi::exp2_approx(m[g] - mx);  // m = -inf gives 0: fine, o and l are 0
      m[g] = mx;
      l[g] *= corr;
#pragma unroll
      for (int i = 0; i < VEC; ++i) o[g][i] *= corr;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float pw = fi::exp2_approx(s[g][u] - mx);
        l[g] += pw;
        float vf[VEC];
        fi_attn::convert<KVT>(vr[u], vf);
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[g][i] = fmaf(pw, vf[i], o[g][i]);
      }
    }
  }

  fi::launch_dependents();  // no more K/V to stream: the next grid may start launching
  // Merge the ROWS softmax states of the CTA through shared memory.
  __shared__ __align__(16) float sm_o[ROWS][GH][D];
  __shared__ float sm_m[ROWS][GH], sm_l[ROWS][GH];
#pragma unroll
  for (int g = 0; g < GH; ++g) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4)
      *reinterpret_cast<float4*>(&sm_o[gr][g][d0 + i]) = make_float4(o[g][i], o[g][i + 1], o[g][i + 2], o[g][i + 3]);
    if (tx == 0) { sm_m[gr][g] = m[g]; sm_l[gr][g] = l[g]; }
  }
  __syncthreads();
  fi_attn::store_merged<QT, D, GH, ROWS, NW * 32>(p, sm_o, sm_m, sm_l, req, qh0, part);
}

__global__ void __launch_bounds__(NW * 32) decode_kernel(const Params p) {
  fi_attn::DecodeWork wk;
  fi_attn::Spread sp;
  if (!fi_attn::decode_work<GH>(p, wk, sp)) return;  // CUDA-graph mode launches the capacity
  do attend(p, wk);
  while (FI_DECODE_SPREAD_MODE &&
         (fi_attn::next_piece<GH>(p, wk) || (sp.sweeper && fi_attn::next_work<GH>(p, wk, sp))));
}

}  // namespace

FI_EXPORT int fi_batch_decode(const DecodeArgs* a) {
  const Params p = fi_attn::make_params<QT, KVT>(a, SOFTCAP, GH);
  return fi_attn::launch_batch_decode<QT, D>(a, p, decode_kernel, NW * 32, 0);
}

FI_EXPORT int fi_batch_decode_occupancy(int* blocks_per_sm) {
  return fi_attn::batch_decode_occupancy(blocks_per_sm, decode_kernel, NW * 32, 0);
}
