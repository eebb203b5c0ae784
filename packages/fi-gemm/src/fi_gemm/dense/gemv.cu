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
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fi/common.cuh"

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

// fp8 MMAs exist from sm_89; these specialisations are only instantiated by fp8 modules, which
// the Python side builds for sm_89+ only.
#define FI_FP8_MMA(TW_, TA_, WS, AS)                                                              \
  template <> struct Mma<TW_, TA_> {                                                              \
    static FI_DEVICE void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, \
                              uint32_t b0, uint32_t b1) {                                         \
      asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." WS "." AS                             \
                   ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                 \
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                               \
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                       \
    }                                                                                             \
  };
FI_FP8_MMA(__nv_fp8_e4m3, __nv_fp8_e4m3, "e4m3", "e4m3")
FI_FP8_MMA(__nv_fp8_e4m3, __nv_fp8_e5m2, "e4m3", "e5m2")
FI_FP8_MMA(__nv_fp8_e5m2, __nv_fp8_e4m3, "e5m2", "e4m3")
FI_FP8_MMA(__nv_fp8_e5m2, __nv_fp8_e5m2, "e5m2", "e5m2")
#undef FI_FP8_MMA

// W is read exactly once: bypass L1 and ask L2 to fetch 256 B around each miss (the CTA's warps
// consume the neighbouring bytes of the row in the same pass).
FI_DEVICE uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Activations are re-read by every CTA: keep them in the caches.
FI_DEVICE uint4 load_cached(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

constexpr int kWarps = 8;

template <typename TA, typename TW, typename TD, typename TB, int NT, int RS, int U>
// Two CTAs per SM keep enough loads in flight; that allows up to 128 registers per thread.
__global__ void __launch_bounds__(kWarps * 32, 2)
gemv_kernel(TD* __restrict__ out, const TA* __restrict__ act, const TW* __restrict__ w,
            const TB* __restrict__ bias, const float* __restrict__ scale_a,
            const float* __restrict__ scale_b, int m, int n, int k, int64_t lda, int64_t ldw,
            int64_t ldo, int64_t bsa, int64_t bsw, int64_t bso,
            const int64_t* __restrict__ seg_indptr, const int64_t* __restrict__ seg_widx,
            int num_segs) {
  static_assert(sizeof(TA) == sizeof(TW), "activation and weight must have the same width");
  constexpr int V = 16 / sizeof(TW);  // elements per 16-byte vector
  constexpr int KSTEP = 4 * V;        // k covered by one warp step (4 lanes across k)
  constexpr int NACC = RS * NT * 4;
  __shared__ float red[kWarps][NACC][32];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  if (seg_indptr != nullptr) {
    // Segment mode (LoRA / grouped GEMM): blockIdx.y enumerates 16-row tiles of all segments in
    // order; the CTA finds its segment by walking the (short) indptr. Uniform across the CTA, so
    // the early return cannot split a __syncthreads.
    const int64_t y = blockIdx.y;
    int64_t cum = 0, row0 = -1;
    int s = 0;
    for (; s < num_segs; ++s) {
      const int64_t b0 = seg_indptr[s];
      const int64_t len = seg_indptr[s + 1] - b0;
      const int64_t tiles = len > 0 ? (len + 15) / 16 : 0;
      if (y < cum + tiles) {
        row0 = b0 + (y - cum) * 16;
        m = int(min(int64_t(16), b0 + len - row0));
        break;
      }
      cum += tiles;
    }
    if (row0 < 0) return;
    act += row0 * lda;
    out += row0 * ldo;
    w += (seg_widx != nullptr ? seg_widx[s] : int64_t(s)) * bsw;
  } else {
    const int64_t batch = blockIdx.z;
    act += batch * bsa;
    w += batch * bsw;
    out += batch * bso;
  }
  const int n0 = blockIdx.x * (16 * RS);

  const TW* wrow[RS][2];
  bool wok[RS][2];
#pragma unroll
  for (int r = 0; r < RS; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = n0 + r * 16 + h * 8 + g;
      wok[r][h] = row < n;
      wrow[r][h] = w + (wok[r][h] ? int64_t(row) * ldw : 0) + t * V;
    }
  const TA* arow[NT];
  bool aok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tok = j * 8 + g;
    aok[j] = tok < m;
    arow[j] = act + (aok[j] ? int64_t(tok) * lda : 0) + t * V;
  }

  float acc[RS][NT][4];
#pragma unroll
  for (int r = 0; r < RS; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[r][j][c] = 0.f;

  const int nsteps = (k + KSTEP - 1) / KSTEP;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int s0 = warp; s0 < nsteps; s0 += kWarps * U) {
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
          wv[u][r][h] = (kok && wok[r][h]) ? load_stream(wrow[r][h] + kk) : zero;
#pragma unroll
      for (int j = 0; j < NT; ++j) av[u][j] = (kok && aok[j]) ? load_cached(arow[j] + kk) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < RS; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          Mma<TW, TA>::run(acc[r][j], wv[u][r][0].x, wv[u][r][1].x, wv[u][r][0].y, wv[u][r][1].y,
                           av[u][j].x, av[u][j].y);
          Mma<TW, TA>::run(acc[r][j], wv[u][r][0].z, wv[u][r][1].z, wv[u][r][0].w, wv[u][r][1].w,
                           av[u][j].z, av[u][j].w);
        }
  }

#pragma unroll
  for (int r = 0; r < RS; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[warp][(r * NT + j) * 4 + c][lane] = acc[r][j][c];
  __syncthreads();

  float scale = 1.f;
  if (scale_a != nullptr) scale *= *scale_a;
  if (scale_b != nullptr) scale *= *scale_b;
  for (int idx = threadIdx.x; idx < NACC * 32; idx += kWarps * 32) {
    const int i = idx >> 5;
    const int ln = idx & 31;
    float sum = 0.f;
#pragma unroll
    for (int wp = 0; wp < kWarps; ++wp) sum += red[wp][i][ln];
    // Accumulator element c of MMA (r, j): W row g + 8 * (c / 2), token 2 * t + c % 2.
    const int c = i & 3;
    const int j = (i >> 2) % NT;
    const int r = (i >> 2) / NT;
    const int row = n0 + r * 16 + (ln >> 2) + 8 * (c >> 1);
    const int tok = j * 8 + 2 * (ln & 3) + (c & 1);
    if (row < n && tok < m) {
      float v = sum * scale;
      if (bias != nullptr) v += to_f32(bias[row]);
      out[int64_t(tok) * ldo + row] = from_f32<TD>(v);
    }
  }
}

template <int NT, int RS, int U>
cudaError_t launch(void* out, const void* act, const void* w, const void* bias, const void* sa,
                   const void* sb, int64_t m, int64_t n, int64_t k, int64_t l, int64_t lda,
                   int64_t ldw, int64_t ldo, int64_t bsa, int64_t bsw, int64_t bso,
                   const int64_t* seg_indptr, const int64_t* seg_widx, int num_segs,
                   int64_t tiles_y, cudaStream_t stream) {
  dim3 grid(unsigned(fi::ceil_div<int64_t>(n, 16 * RS)), unsigned(tiles_y), unsigned(l));
  gemv_kernel<FI_TA, FI_TW, FI_TD, FI_TBIAS, NT, RS, U><<<grid, kWarps * 32, 0, stream>>>(
      static_cast<FI_TD*>(out), static_cast<const FI_TA*>(act), static_cast<const FI_TW*>(w),
      static_cast<const FI_TBIAS*>(bias), static_cast<const float*>(sa),
      static_cast<const float*>(sb), int(m), int(n), int(k), lda, ldw, ldo, bsa, bsw, bso,
      seg_indptr, seg_widx, num_segs);
  return cudaGetLastError();
}

}  // namespace

// m <= 16; k a multiple of 16 bytes of elements; rows of A and W 16-byte aligned (checked in
// Python, re-checked here as a cheap guard against out-of-bounds vector loads).
FI_EXPORT int fi_gemv(void* out, const void* act, const void* w, const void* bias,
                      const void* scale_a, const void* scale_b, int64_t m, int64_t n, int64_t k,
                      int64_t l, int64_t lda, int64_t ldw, int64_t ldo, int64_t bsa, int64_t bsw,
                      int64_t bso, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(FI_TW);
  if (m < 0 || m > 16 || k % V != 0 || lda % V != 0 || ldw % V != 0 ||
      (reinterpret_cast<uintptr_t>(act) | reinterpret_cast<uintptr_t>(w)) % 16 != 0 ||
      n >= (int64_t(1) << 31) || k >= (int64_t(1) << 31) || l > 65535)
    return (int)cudaErrorInvalidValue;
  if (m == 0 || n == 0 || l == 0) return 0;
  // Two slabs per CTA halve the activation re-reads once there are enough rows for every SM;
  // below that, one slab per CTA keeps all SMs streaming.
  const bool two_slabs = fi::ceil_div<int64_t>(n, 32) * l >= fi::sm_count();
  cudaError_t e;
#define FI_GEMV_ARGS out, act, w, bias, scale_a, scale_b, m, n, k, l, lda, ldw, ldo, bsa, bsw, bso, \
                     nullptr, nullptr, 0, 1, stream
  if (m <= 8) {
    e = two_slabs ? launch<1, 2, 3>(FI_GEMV_ARGS) : launch<1, 1, 4>(FI_GEMV_ARGS);
  } else {
    e = two_slabs ? launch<2, 2, 2>(FI_GEMV_ARGS) : launch<2, 1, 4>(FI_GEMV_ARGS);
  }
#undef FI_GEMV_ARGS
  return (int)e;
}

// Segment GEMM: rows seg_indptr[s] .. seg_indptr[s+1] of x times W[seg_widx[s]]^T (seg_widx null:
// W[s]). x is [total_rows, k], W is [*, n, k] with batch stride bsw, out is [total_rows, n].
// Rows outside every segment are not written. Graph-safe: the grid is sized from total_rows and
// num_segs (host values); segment lengths are read on the device.
FI_EXPORT int fi_gemv_segment(void* out, const void* x, const void* w, const void* seg_indptr,
                              const void* seg_widx, int64_t total_rows, int64_t num_segs,
                              int64_t n, int64_t k, int64_t ldx, int64_t ldw, int64_t ldo,
                              int64_t bsw, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(FI_TW);
  if (k % V != 0 || ldx % V != 0 || ldw % V != 0 || bsw % V != 0 ||
      (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 != 0 ||
      n >= (int64_t(1) << 31) || k >= (int64_t(1) << 31) || num_segs >= (int64_t(1) << 31))
    return (int)cudaErrorInvalidValue;
  // sum_s ceil(len_s / 16) <= floor(total / 16) + num_segs; surplus CTAs exit at once.
  const int64_t tiles = total_rows / 16 + num_segs;
  if (tiles == 0 || n == 0) return 0;
  if (tiles > 65535) return (int)cudaErrorInvalidConfiguration;
  const bool two_slabs = fi::ceil_div<int64_t>(n, 32) * tiles >= fi::sm_count();
  const int64_t* ip = static_cast<const int64_t*>(seg_indptr);
  const int64_t* wi = static_cast<const int64_t*>(seg_widx);
#define FI_SEG_ARGS out, x, w, nullptr, nullptr, nullptr, 16, n, k, 1, ldx, ldw, ldo, 0, bsw, 0, \
                    ip, wi, int(num_segs), tiles, stream
  cudaError_t e = two_slabs ? launch<2, 2, 2>(FI_SEG_ARGS) : launch<2, 1, 4>(FI_SEG_ARGS);
#undef FI_SEG_ARGS
  return (int)e;
}
