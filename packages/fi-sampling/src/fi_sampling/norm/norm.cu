// RMSNorm, fused add + RMSNorm (plain and Gemma-style weights) and LayerNorm over the last dim.
//
// Single pass: each row is read once into registers, reduced, scaled and written, so the kernel
// moves the minimum number of bytes (rmsnorm: read x + write y; fused: read x, r + write r, y).
// A "row group" of `tpr` threads owns one row; a block holds 128/tpr groups when rows are short
// (QK-norm over head_dim 128) and a single group when they are long. Each thread holds NV
// vectors of VW elements; VW is the widest access (16 bytes at best) that divides the hidden size,
// every row stride and the pointer alignment, so there is never a partial vector. Rows longer than
// the register budget (NV * VW > 32 floats per thread) use the two-pass loop kernel instead.
//
// Rows are addressed with two strides, row r -> (r / inner) * s0 + (r % inner) * s1, which covers
// 2-D [tokens, hidden] (inner = 1) and 3-D [tokens, heads, head_dim] views such as q sliced out of
// a fused qkv tensor. `in` and `out` may alias (fused_add_rmsnorm writes in place): every element
// is read and written by the same thread, so no pointer is __restrict__ and no .nc loads are used.
//
// enable_pdl: accepted by the Python API and ignored here (plain stream-ordered launches).
#include <initializer_list>

#include "fi/common.cuh"
#include "fi/reduce.cuh"
#include "fi/vec.cuh"

#ifndef FI_T
#define FI_T __nv_bfloat16
#endif
// Vectors per thread the fused register kernel starts from (plan_rows grows it for long rows).
// 2 rather than 4: 8192-wide bf16 rows then take 512 threads at 64 registers (2 blocks, 1024
// threads per SM) instead of 256 threads at ~75 registers (3 blocks, 768 threads); measured on the
// H200, 129.9 us instead of 145.4 us (fused_add_rmsnorm bench routine, option fused_nv=N builds
// a module with another value for A/B runs).
#ifndef FI_FUSED_NV
#define FI_FUSED_NV 2
#endif

namespace {

using T = FI_T;
static_assert(sizeof(T) == 2, "norm kernels are instantiated for fp16/bf16 (VW <= 8)");
constexpr int kBlockMin = 128;     // threads per block when several rows share a block
constexpr int kMaxFloats = 32;     // NV * VW cap: the row stays in registers without spills
constexpr int kMaxThreads = 1024;  // loop kernels
constexpr int kRegsThreads = 512;  // register kernels: at most 512 threads per block ...
// Register cap of the register kernels: the packed row arrays (x, and r when fused), ~4
// registers of address/predicate state per vector slot, and ~32 for the rest; rounded to 8,
// at least 64 (4 blocks of 256 threads per SM: 64 KB of x loads in flight) and at most 120
// (a 512-thread block then needs 60K of the 64K registers, within the allocation granularity). The main case, 8192 bf16
// (VW 8, NV 4), gets 64; Little's law asks ~25 KB in flight per SM of HBM3e.
constexpr int regs_cap(int vw, int nv, int arrays) {
  const int words = nv * (vw >= 2 ? vw / 2 : 1) * arrays + 4 * nv + 32;
  const int r = (words + 7) / 8 * 8;
  return r < 64 ? 64 : (r > 120 ? 120 : r);
}

FI_DEVICE void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Load that does not allocate in L1 (plain coherent ld.global otherwise, so in-place calls stay
// correct): for row data read exactly once, which would otherwise evict the per-column
// parameters that every row of the SM re-reads from L1.
template <int VW>
FI_DEVICE void load_no_l1(fi::vec_t<T, VW>& v, const T* p) {
  if constexpr (VW * sizeof(T) == 16) {
    uint4 r;
    asm("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    *reinterpret_cast<uint4*>(&v) = r;
  } else {
    v.load(p);
  }
}

struct RowMap {
  int64_t inner, s0, s1;
  FI_DEVICE int64_t offset(int64_t r) const {
    return inner == 1 ? r * s0 : (r / inner) * s0 + (r % inner) * s1;
  }
};

// Sum over the `tpr` threads of one row group. tpr <= 32 is a power of two, so groups are aligned
// lane ranges inside a warp and xor-shuffles with offsets < tpr never cross groups. tpr > 32 is a
// multiple of 32; partial sums go through shared memory. Every thread of the block must call this
// (rows past the end included) because of the shuffles and barriers.
FI_DEVICE float group_sum(float v, int tpr, int group, int lane_in_group, float* scratch) {
  if (tpr <= 32) {
    for (int o = tpr >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(fi::kFullMask, v, o);
    return v;
  }
  v = fi::warp_sum(v);
  if ((threadIdx.x & 31) == 0) scratch[group * 32 + (lane_in_group >> 5)] = v;
  __syncthreads();
  float r = 0.f;
  const int nw = tpr >> 5;
  for (int i = 0; i < nw; ++i) r += scratch[group * 32 + i];  // fixed order: deterministic
  __syncthreads();  // scratch is reused by the next reduction
  return r;
}

// Shared-memory partials: at most 32 warps per group, and at most 2 groups when tpr > 32
// (tpr = 64 -> 2 rows per 128-thread block).
constexpr int kScratch = 4 * 32;

// out = x * rsqrt(mean(x^2) + eps) * (w + w_offset); with FUSED, x = round(in + res) is first
// written back to res (the rounded sum is what gets normalised, as FlashInfer does).
//
// Fused only: `ahead` > 0 is the number of rows resident on the whole GPU (blocks per SM x SMs x
// rows per block). After the reduction a thread prefetches its slots of row `row + ahead` into
// L2, so the block that takes over a slot about one block lifetime later finds its 2 input rows
// in L2. A block has loads in flight only until its row arrives, then reduces and stores; the
// prefetches keep HBM reads queued through those phases. No data registers; L2 holds one extra
// wave of inputs (264 x 32 KB at 8192 bf16: 2 blocks of one row per SM).
template <int VW, int NV, bool FUSED>
__global__ void __maxnreg__(regs_cap(VW, NV, FUSED ? 2 : 1))
rmsnorm_regs_kernel(T* out, const T* in, T* res, const T* __restrict__ w, int64_t rows, int cols,
                    RowMap mo, RowMap mi, RowMap mr, float eps, float w_offset, int tpr,
                    int64_t ahead) {
  using V = fi::vec_t<T, VW>;
  __shared__ float scratch[kScratch];
  const int groups = blockDim.x / tpr;
  const int group = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  const int64_t row = (int64_t)blockIdx.x * groups + group;
  const bool valid = row < rows;
  const int nvec = cols / VW;

  const T* xrow = in + (valid ? mi.offset(row) : 0);
  T* rrow = FUSED ? res + (valid ? mr.offset(row) : 0) : nullptr;
  T* orow = out + (valid ? mo.offset(row) : 0);
  // The row is kept packed (T, not float): half the registers of a float copy, so more blocks
  // fit per SM and more bytes are in flight; converting again for the output costs ~1 ALU op.
  // All loads are issued before the first store: `res` may alias nothing we know of, so the
  // compiler could not move a later load above a residual store and loads would serialise.
  // The weight is read after the reduction: every block of the SM reads the same row of it,
  // so it is an L1 hit, and not holding it through the reduction saves 16 registers (4 blocks
  // of 256 threads per SM instead of 3 in the 8192-wide bf16 case).
  V xv[NV], rv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int v = lane + i * tpr;
    if (valid && v < nvec) {
      xv[i].load(xrow + (int64_t)v * VW);
      if constexpr (FUSED) rv[i].load(rrow + (int64_t)v * VW);
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int v = lane + i * tpr;
    if (valid && v < nvec) {
      if constexpr (FUSED) {
#pragma unroll
        for (int j = 0; j < VW; ++j)
          xv[i][j] = fi::from_float<T>(fi::to_float(xv[i][j]) + fi::to_float(rv[i][j]));
        xv[i].store(rrow + (int64_t)v * VW);
      }
#pragma unroll
      for (int j = 0; j < VW; ++j) {
        const float f = fi::to_float(xv[i][j]);
        ss += f * f;
      }
    }
  }
  ss = group_sum(ss, tpr, group, lane, scratch);
  const float rrms = rsqrtf(ss / (float)cols + eps);
  // Here, not right after the loads: rv is dead by now, so the prefetch addresses cost no spills.
  if constexpr (FUSED) {
    const int64_t next = row + ahead;
    if (ahead > 0 && next < rows) {
      const T* xn = in + mi.offset(next);
      const T* rn = res + mr.offset(next);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int v = lane + i * tpr;
        if (v < nvec) {
          prefetch_l2(xn + (int64_t)v * VW);
          prefetch_l2(rn + (int64_t)v * VW);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int v = lane + i * tpr;
    if (valid && v < nvec) {
      V o, wv;
      wv.load(w + (int64_t)v * VW);
#pragma unroll
      for (int j = 0; j < VW; ++j)
        o[j] = fi::from_float<T>(fi::to_float(xv[i][j]) * rrms * (fi::to_float(wv[j]) + w_offset));
      o.store(orow + (int64_t)v * VW);
    }
  }
}

// Rows too long for registers: pass 1 reduces (and writes the fused residual), pass 2 re-reads
// the row (now mostly in L2) and writes the output. One block per row.
template <int VW, bool FUSED>
__global__ void __launch_bounds__(kMaxThreads)
rmsnorm_loop_kernel(T* out, const T* in, T* res, const T* __restrict__ w, int64_t rows, int cols,
                    RowMap mo, RowMap mi, RowMap mr, float eps, float w_offset) {
  using V = fi::vec_t<T, VW>;
  __shared__ float scratch[kScratch];
  const int64_t row = blockIdx.x;
  const int nvec = cols / VW;
  const T* src = FUSED ? res + mr.offset(row) : in + mi.offset(row);
  float ss = 0.f;
  for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
    V a;
    a.load(in + mi.offset(row) + (int64_t)v * VW);
    if constexpr (FUSED) {
      V b;
      b.load(res + mr.offset(row) + (int64_t)v * VW);
#pragma unroll
      for (int j = 0; j < VW; ++j) a[j] = fi::from_float<T>(fi::to_float(a[j]) + fi::to_float(b[j]));
      a.store(res + mr.offset(row) + (int64_t)v * VW);  // re-read below by this same thread
    }
#pragma unroll
    for (int j = 0; j < VW; ++j) ss += fi::to_float(a[j]) * fi::to_float(a[j]);
  }
  ss = group_sum(ss, blockDim.x, 0, threadIdx.x, scratch);
  const float rrms = rsqrtf(ss / (float)cols + eps);
  for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
    V a, wv, o;
    a.load(src + (int64_t)v * VW);
    wv.load(w + (int64_t)v * VW);
#pragma unroll
    for (int j = 0; j < VW; ++j)
      o[j] = fi::from_float<T>(fi::to_float(a[j]) * rrms * (fi::to_float(wv[j]) + w_offset));
    o.store(out + mo.offset(row) + (int64_t)v * VW);
  }
}

// LayerNorm with float32 gain/bias (FlashInfer's convention): mean and variance from the
// register-resident row (two reductions, so no E[x^2] - E[x]^2 cancellation). The gain and bias
// are 8 bytes per column against 2 for x: at 8192 columns 64 KB that every row of the SM
// re-reads, so x is loaded without L1 allocation to leave L1 to them (else they come from L2).
// x is held packed (T) and converted on each use (exact, ~1 instruction), like RMSNorm: the
// 8192-wide bf16 case then fits 64 registers (4 blocks of 256 threads per SM; as floats it took
// ~70, 3 blocks, and spilled at 64).
constexpr int ln_cap(int vw, int nv) { return vw >= 4 && vw * nv == 32 ? 64 : regs_cap(vw, nv, 2); }

template <int VW, int NV>
__global__ void __maxnreg__(ln_cap(VW, NV))
layernorm_regs_kernel(T* out, const T* in, const float* __restrict__ g, const float* __restrict__ b,
                      int64_t rows, int cols, RowMap mo, RowMap mi, float eps, int tpr) {
  using V = fi::vec_t<T, VW>;
  using G = fi::vec_t<float, VW>;  // gemma/beta: float32, aligned to VW floats by the launcher
  __shared__ float scratch[kScratch];
  const int groups = blockDim.x / tpr;
  const int group = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  const int64_t row = (int64_t)blockIdx.x * groups + group;
  const bool valid = row < rows;
  const int nvec = cols / VW;
  V x[NV];
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int v = lane + i * tpr;
    if (valid && v < nvec) {
      load_no_l1<VW>(x[i], in + mi.offset(row) + (int64_t)v * VW);
#pragma unroll
      for (int j = 0; j < VW; ++j) s += fi::to_float(x[i][j]);
    }
  }
  const float mean = group_sum(s, tpr, group, lane, scratch) / (float)cols;
  float q = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int v = lane + i * tpr;
    if (valid && v < nvec) {
#pragma unroll
      for (int j = 0; j < VW; ++j) { const float d = fi::to_float(x[i][j]) - mean; q += d * d; }
    }
  }
  const float rstd = rsqrtf(group_sum(q, tpr, group, lane, scratch) / (float)cols + eps);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int v = lane + i * tpr;
    if (valid && v < nvec) {
      V o;
      G gv, bv;
      gv.load(g + (int64_t)v * VW);
      bv.load(b + (int64_t)v * VW);
#pragma unroll
      for (int j = 0; j < VW; ++j)
        o[j] = fi::from_float<T>((fi::to_float(x[i][j]) - mean) * rstd * gv[j] + bv[j]);
      o.store(out + mo.offset(row) + (int64_t)v * VW);
    }
  }
}

template <int VW>
__global__ void __launch_bounds__(kMaxThreads)
layernorm_loop_kernel(T* out, const T* in, const float* __restrict__ g, const float* __restrict__ b,
                      int64_t rows, int cols, RowMap mo, RowMap mi, float eps) {
  using V = fi::vec_t<T, VW>;
  using G = fi::vec_t<float, VW>;
  __shared__ float scratch[kScratch];
  const T* src = in + mi.offset(blockIdx.x);
  const int nvec = cols / VW;
  float s = 0.f;
  for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
    V a;
    a.load(src + (int64_t)v * VW);
#pragma unroll
    for (int j = 0; j < VW; ++j) s += fi::to_float(a[j]);
  }
  const float mean = group_sum(s, blockDim.x, 0, threadIdx.x, scratch) / (float)cols;
  float q = 0.f;
  for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
    V a;
    a.load(src + (int64_t)v * VW);
#pragma unroll
    for (int j = 0; j < VW; ++j) { const float d = fi::to_float(a[j]) - mean; q += d * d; }
  }
  const float rstd = rsqrtf(group_sum(q, blockDim.x, 0, threadIdx.x, scratch) / (float)cols + eps);
  for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
    V a, o;
    G gv, bv;
    a.load(src + (int64_t)v * VW);
    gv.load(g + (int64_t)v * VW);
    bv.load(b + (int64_t)v * VW);
#pragma unroll
    for (int j = 0; j < VW; ++j) o[j] = fi::from_float<T>((fi::to_float(a[j]) - mean) * rstd * gv[j] + bv[j]);
    o.store(out + mo.offset(blockIdx.x) + (int64_t)v * VW);
  }
}

// ---- launch planning -------------------------------------------------------------------------

struct Plan {
  int nv;       // vectors per thread (0: loop kernel)
  int tpr;      // threads per row group
  int block;    // threads per block
  int64_t grid;
};

// Widest vector (in elements) that divides cols and every stride, with all pointers aligned.
int pick_vw(int cols, std::initializer_list<int64_t> strides, std::initializer_list<const void*> ptrs) {
  for (int vw = 16 / (int)sizeof(T); vw > 1; vw >>= 1) {
    bool ok = cols % vw == 0;
    for (int64_t s : strides) ok = ok && s % vw == 0;
    for (const void* p : ptrs) ok = ok && fi::is_aligned(p, vw * (int)sizeof(T));
    if (ok) return vw;
  }
  return 1;
}

// Start from start_nv vectors per thread (4 = 64 bytes in flight per thread at VW = 16 B; the fused
// kernel starts from FI_FUSED_NV); more only when the row needs more than kRegsThreads threads and
// the floats still fit (NV * VW <= kMaxFloats).
Plan plan_rows(int64_t rows, int cols, int vw, int max_nv, int start_nv = 4) {
  const int nvec = cols / vw;
  Plan p{};
  int nv = start_nv * vw <= kMaxFloats ? start_nv : kMaxFloats / vw;
  int64_t need = fi::ceil_div<int64_t>(nvec, nv);
  while (need > kRegsThreads && 2 * nv * vw <= kMaxFloats && 2 * nv <= max_nv) {
    nv *= 2;
    need = fi::ceil_div<int64_t>(nvec, nv);
  }
  if (need > kRegsThreads) {
    p.nv = 0;
    p.tpr = p.block = kMaxThreads / 2;  // 512 threads: several rows per SM keep HBM busy
    p.grid = rows;
    return p;
  }
  int tpr = 4;
  while (tpr < need && tpr < 32) tpr <<= 1;
  if (need > 32) tpr = (int)fi::round_up<int64_t>(need, 32);
  while (nv > 1 && (int64_t)tpr * (nv / 2) >= nvec) nv >>= 1;  // fewest vectors that cover the row
  if (nv == 1) nv = 2;                                         // NV in {2, 4, 8, 16} is instantiated
  p.nv = nv;
  p.tpr = tpr;
  p.block = tpr >= kBlockMin ? tpr : tpr * (kBlockMin / tpr);
  p.grid = fi::ceil_div<int64_t>(rows, p.block / tpr);
  return p;
}

// Rows resident on the GPU at once for `kernel` (0: unknown), given the blocks per SM that the
// caller caches per kernel and block size.
template <typename K>
int64_t resident_rows(K kernel, const Plan& p, int& blocks_per_sm) {
  if (blocks_per_sm == 0 &&
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, p.block, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    blocks_per_sm = -1;
  }
  return blocks_per_sm > 0 ? (int64_t)blocks_per_sm * fi::sm_count() * (p.block / p.tpr) : 0;
}

template <int VW, int NV, bool FUSED>
void launch_regs(const Plan& p, T* out, const T* in, T* res, const T* w, int64_t rows, int cols,
                 RowMap mo, RowMap mi, RowMap mr, float eps, float wo, cudaStream_t st) {
  auto kernel = rmsnorm_regs_kernel<VW, NV, FUSED>;
  static int blocks_per_sm[kRegsThreads + 1] = {};  // this kernel, by block size (<= 512)
  // Prefetching the next wave only pays when there is one.
  int64_t ahead = FUSED ? resident_rows(kernel, p, blocks_per_sm[p.block]) : 0;
  if (ahead >= rows) ahead = 0;
  kernel<<<dim3((unsigned)p.grid), dim3(p.block), 0, st>>>(out, in, res, w, rows, cols, mo, mi, mr,
                                                           eps, wo, p.tpr, ahead);
}

template <int VW, bool FUSED>
cudaError_t launch_rms(const Plan& p, T* out, const T* in, T* res, const T* w, int64_t rows,
                       int cols, RowMap mo, RowMap mi, RowMap mr, float eps, float wo,
                       cudaStream_t st) {
  const dim3 grid((unsigned)p.grid), block(p.block);
  switch (p.nv) {
    case 0: rmsnorm_loop_kernel<VW, FUSED><<<grid, block, 0, st>>>(out, in, res, w, rows, cols, mo, mi, mr, eps, wo); break;
    case 2: launch_regs<VW, 2, FUSED>(p, out, in, res, w, rows, cols, mo, mi, mr, eps, wo, st); break;
    case 4: if constexpr (4 * VW <= kMaxFloats) { launch_regs<VW, 4, FUSED>(p, out, in, res, w, rows, cols, mo, mi, mr, eps, wo, st); break; }
            return cudaErrorInvalidConfiguration;
    case 8: if constexpr (8 * VW <= kMaxFloats) { launch_regs<VW, 8, FUSED>(p, out, in, res, w, rows, cols, mo, mi, mr, eps, wo, st); break; }
            return cudaErrorInvalidConfiguration;
    case 16: if constexpr (16 * VW <= kMaxFloats && !FUSED) { launch_regs<VW, 16, FUSED>(p, out, in, res, w, rows, cols, mo, mi, mr, eps, wo, st); break; }
            return cudaErrorInvalidConfiguration;
    default: return cudaErrorInvalidConfiguration;
  }
  return cudaGetLastError();
}

template <int VW>
cudaError_t launch_ln(const Plan& p, T* out, const T* in, const float* g, const float* b,
                      int64_t rows, int cols, RowMap mo, RowMap mi, float eps, cudaStream_t st) {
  const dim3 grid((unsigned)p.grid), block(p.block);
  switch (p.nv) {
    case 0: layernorm_loop_kernel<VW><<<grid, block, 0, st>>>(out, in, g, b, rows, cols, mo, mi, eps); break;
    case 2: layernorm_regs_kernel<VW, 2><<<grid, block, 0, st>>>(out, in, g, b, rows, cols, mo, mi, eps, p.tpr); break;
    case 4: if constexpr (4 * VW <= kMaxFloats) { layernorm_regs_kernel<VW, 4><<<grid, block, 0, st>>>(out, in, g, b, rows, cols, mo, mi, eps, p.tpr); break; }
            return cudaErrorInvalidConfiguration;
    case 8: if constexpr (8 * VW <= kMaxFloats) { layernorm_regs_kernel<VW, 8><<<grid, block, 0, st>>>(out, in, g, b, rows, cols, mo, mi, eps, p.tpr); break; }
            return cudaErrorInvalidConfiguration;
    case 16: if constexpr (16 * VW <= kMaxFloats) { layernorm_regs_kernel<VW, 16><<<grid, block, 0, st>>>(out, in, g, b, rows, cols, mo, mi, eps, p.tpr); break; }
            return cudaErrorInvalidConfiguration;
    default: return cudaErrorInvalidConfiguration;
  }
  return cudaGetLastError();
}

}  // namespace

// Row strides in elements: row r of a tensor sits at (r / inner) * s0 + (r % inner) * s1.
// residual == nullptr: plain RMSNorm; else fused add (out usually == in). weight_offset is 0
// for RMSNorm and 1 for Gemma's (1 + w).
FI_EXPORT int fi_rmsnorm(void* out, const void* in, void* residual, const void* weight,
                         int64_t rows, int64_t cols, int64_t inner,
                         int64_t out_s0, int64_t out_s1, int64_t in_s0, int64_t in_s1,
                         int64_t res_s0, int64_t res_s1, float eps, float weight_offset,
                         cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (cols > (1LL << 30) || inner <= 0) return cudaErrorInvalidValue;
  const bool fused = residual != nullptr;
  const int c = (int)cols;
  const int vw = fused ? pick_vw(c, {out_s0, out_s1, in_s0, in_s1, res_s0, res_s1}, {out, in, residual, weight})
                       : pick_vw(c, {out_s0, out_s1, in_s0, in_s1}, {out, in, weight});
  const RowMap mo{inner, out_s0, out_s1}, mi{inner, in_s0, in_s1}, mr{inner, res_s0, res_s1};
  // Fused rows hold three arrays; 16 vectors of <= 4 bytes per thread would not fit in 128 regs.
  const Plan p = plan_rows(rows, c, vw, fused ? 8 : 16, fused ? FI_FUSED_NV : 4);
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(in);
  T* r = static_cast<T*>(residual);
  const T* w = static_cast<const T*>(weight);
  cudaError_t e;
#define FI_RMS_CASE(VW_)                                                                              \
  case VW_:                                                                                           \
    e = fused ? launch_rms<VW_, true>(p, o, x, r, w, rows, c, mo, mi, mr, eps, weight_offset, stream) \
              : launch_rms<VW_, false>(p, o, x, r, w, rows, c, mo, mi, mr, eps, weight_offset, stream); \
    break;
  switch (vw) {
    FI_RMS_CASE(1)
    FI_RMS_CASE(2)
    FI_RMS_CASE(4)
    FI_RMS_CASE(8)
    default: e = cudaErrorInvalidConfiguration;
  }
#undef FI_RMS_CASE
  return (int)e;
}

FI_EXPORT int fi_layernorm(void* out, const void* in, const void* gemma, const void* beta,
                           int64_t rows, int64_t cols, int64_t out_s0, int64_t in_s0, float eps,
                           cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (cols > (1LL << 30)) return cudaErrorInvalidValue;
  const int c = (int)cols;
  int vw = pick_vw(c, {out_s0, in_s0}, {out, in});
  // gemma/beta (float32) are read as VW-float vectors: they must be aligned to VW * 4 bytes.
  while (vw > 1 && !(fi::is_aligned(gemma, vw * 4) && fi::is_aligned(beta, vw * 4))) vw >>= 1;
  const RowMap mo{1, out_s0, 0}, mi{1, in_s0, 0};
  const Plan p = plan_rows(rows, c, vw, 16);
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(in);
  const float* g = static_cast<const float*>(gemma);
  const float* b = static_cast<const float*>(beta);
  cudaError_t e;
  switch (vw) {
    case 1: e = launch_ln<1>(p, o, x, g, b, rows, c, mo, mi, eps, stream); break;
    case 2: e = launch_ln<2>(p, o, x, g, b, rows, c, mo, mi, eps, stream); break;
    case 4: e = launch_ln<4>(p, o, x, g, b, rows, c, mo, mi, eps, stream); break;
    case 8: e = launch_ln<8>(p, o, x, g, b, rows, c, mo, mi, eps, stream); break;
    default: e = cudaErrorInvalidConfiguration;
  }
  return (int)e;
}
