// FP4 weight-streaming GEMM for decode shapes (M <= 16): out[m, n] = alpha * sum_k A[m, k] W[n, k]
// with W packed e2m1 ([n, k / 2] bytes) and its block scales (128x4 layout), A in bf16 (mm_fp4's
// activations after fi_fp4_dequant: code * scale, exact). At M <= 16 the GEMM is a pass over W,
// so reading W packed (0.5 byte per weight plus 1/16 or 1/32 of a scale byte) instead of as a bf16
// copy (2 bytes, written by the dequantiser first) is what makes FP4 pay on Hopper.
//
// Tensor cores without FP4 support: each thread expands its codes in registers to bf16 with the
// block scale folded in (code * scale is exact in bf16, see dequant.cu) and feeds m16n8k16 bf16
// MMAs, W as the MMA's 16-row A operand, the tokens as its 8-column B operand, fp32 accumulators.
// Thread (g = lane / 4, t = lane % 4) of a warp loads 16 bytes (32 codes) of W rows g and g + 8 at
// k0 = 128 * step + 32 * t, and the same 32 activations of token g (and g + 8 when M > 8). Its
// elements 4j..4j+3 serve MMA j (j = 0..7) as the logical k 2t, 2t+1, 2t+8, 2t+9 of both operands:
// a dot product does not care which physical k meets which logical one, as long as A and B agree,
// and here each lane's own W and activation chunk supply both (mma.cuh has the fragment layouts).
//
// Work split: a CTA owns 16 W rows; its 8 warps take interleaved 128-wide K steps (U in flight per
// warp) and meet in shared memory at the end, where warp 0 applies alpha and stores.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fi/common.cuh"
#include "fi/mma.cuh"

#ifndef FI_TD
#define FI_TD __nv_bfloat16
#endif

namespace {

using TD = FI_TD;
constexpr int kWarps = 8;

template <typename T> FI_DEVICE T from_f32(float x);
template <> FI_DEVICE __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> FI_DEVICE __half from_f32<__half>(float x) { return __float2half_rn(x); }

struct Params {
  TD* out;                    // [m, n], row stride ldo
  const __nv_bfloat16* act;   // [m, k], row stride lda
  const uint8_t* w;           // [n, k / 2], row stride ldw bytes
  const uint8_t* sf;          // W's scale bytes, 128x4 layout
  const float* alpha;         // one value, or null (1)
  int m, n, k;
  int64_t lda, ldw, ldo;
  int k_tiles;                // ceil(k / block / 4): 4-column tiles of the scale layout
};

// W is read once: past L1, with L2 fetching the 128 bytes around each miss (the row's other
// lanes read them in the same step).
FI_DEVICE uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The activations are re-read by every CTA: through the caches.
FI_DEVICE uint4 load_cached(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

// Four codes (16 bits, element 0 in the low nibble) -> two bf16x2 words (elements 0,1 and 2,3).
// The magnitude's 3 bits select, by byte permute, the high and the low byte of its bf16 pattern
// from two 8-byte tables (0, 0.5, 1, 1.5, 2, 3, 4, 6 = 0x0000 0x3f00 0x3f80 0x3fc0 0x4000 0x4040
// 0x4080 0x40c0); the sign bit moves to bit 15. About 3 instructions per code where float math
// takes 8, which matters: at M = 1 these conversions are most of the kernel's instructions.
FI_DEVICE void e2m1x4_to_bf16(uint32_t codes, uint32_t& w01, uint32_t& w23) {
  const uint32_t sel = codes & 0x7777u;
  uint32_t hi, lo;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(hi) : "r"(0x3f3f3f00u), "r"(0x40404040u), "r"(sel));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(lo) : "r"(0xc0800000u), "r"(0xc0804000u), "r"(sel));
  // interleave: bf16 i = hi.byte[i] : lo.byte[i]
  uint32_t a, b;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(a) : "r"(lo), "r"(hi), "r"(0x5140u));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(b) : "r"(lo), "r"(hi), "r"(0x7362u));
  // signs: code i's bit 3 sits at bit 4i + 3; bf16 i's sign at bit 15 / 31 of its word
  w01 = a | ((codes << 12) & 0x8000u) | ((codes << 24) & 0x80000000u);
  w23 = b | ((codes << 4) & 0x8000u) | ((codes << 16) & 0x80000000u);
}

FI_DEVICE uint32_t bf16x2_mul(uint32_t x, __nv_bfloat162 s) {
  __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&x);
  v = __hmul2(v, s);  // exact: a 2-bit times a 4-bit significand, within bf16's range
  return *reinterpret_cast<uint32_t*>(&v);
}

template <bool UE8M0>
FI_DEVICE __nv_bfloat16 scale_bf16(uint32_t byte) {
  if (UE8M0) {  // 2^(byte - 127) is bf16 with exponent field `byte`; 0 is 2^-127 (subnormal)
    const uint16_t bits = byte == 0u ? uint16_t(0x0040u) : byte == 255u ? uint16_t(0x7fc0u) : uint16_t(byte << 7);
    return __ushort_as_bfloat16(bits);
  }
  __nv_fp8_e4m3 s;
  s.__x = static_cast<__nv_fp8_storage_t>(byte);
  return __float2bfloat16_rn(static_cast<float>(s));  // exact: e4m3 fits bf16
}

// Scale-byte offset of (row r, column c) in the 128x4 layout (fi_gemm/fp4/reference.py).
FI_DEVICE int64_t sf_offset(int64_t r, int c, int k_tiles) {
  return ((r >> 7) * k_tiles + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3);
}

// NT: 8-token MMA column tiles (1: M <= 8, 2: M <= 16). U: K steps in flight per warp.
// UE8M0: MXFP4 (one scale per 32 codes, i.e. per thread and step) instead of NVFP4 (two).
template <int NT, int U, bool UE8M0>
__global__ void __launch_bounds__(kWarps * 32, 2) gemv_fp4_kernel(const Params p) {
  __shared__ float red[kWarps][NT * 4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t row_a = int64_t(blockIdx.x) * 16 + g, row_b = row_a + 8;
  const bool va = row_a < p.n, vb = row_b < p.n;
  const uint8_t* wa = p.w + (va ? row_a : 0) * p.ldw;
  const uint8_t* wb = p.w + (vb ? row_b : 0) * p.ldw;
  const int steps = (p.k + 127) / 128;
  float acc[NT][4] = {};

  for (int s0 = warp; s0 < steps; s0 += kWarps * U) {
    uint4 cw[U][2];
    uint32_t sw[U][2];
    uint4 av[U][NT][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u * kWarps;
      const int k0 = s * 128 + t * 32;
      const bool ok = s < steps && k0 < p.k;  // k is a multiple of 32: a chunk is whole or absent
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      cw[u][0] = ok && va ? load_stream(wa + k0 / 2) : zero;
      cw[u][1] = ok && vb ? load_stream(wb + k0 / 2) : zero;
      if (UE8M0) {
        const int c = k0 >> 5;
        sw[u][0] = ok && va ? uint32_t(__ldg(p.sf + sf_offset(row_a, c, p.k_tiles))) : 0u;
        sw[u][1] = ok && vb ? uint32_t(__ldg(p.sf + sf_offset(row_b, c, p.k_tiles))) : 0u;
      } else {  // columns c, c + 1 (c even) are adjacent bytes of one 4-column group
        const int c = k0 >> 4;
        sw[u][0] = ok && va ? uint32_t(__ldg(reinterpret_cast<const uint16_t*>(p.sf + sf_offset(row_a, c, p.k_tiles)))) : 0u;
        sw[u][1] = ok && vb ? uint32_t(__ldg(reinterpret_cast<const uint16_t*>(p.sf + sf_offset(row_b, c, p.k_tiles)))) : 0u;
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int tok = j * 8 + g;
        const bool okt = ok && tok < p.m;
        const __nv_bfloat16* ap = p.act + int64_t(okt ? tok : 0) * p.lda + k0;
#pragma unroll
        for (int q = 0; q < 4; ++q) av[u][j][q] = okt ? load_cached(ap + 8 * q) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      __nv_bfloat162 sc[2][2];  // [row][16-code half]
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const __nv_bfloat16 s_lo = scale_bf16<UE8M0>(sw[u][r] & 0xffu);
        const __nv_bfloat16 s_hi = UE8M0 ? s_lo : scale_bf16<UE8M0>(sw[u][r] >> 8);
        sc[r][0] = __halves2bfloat162(s_lo, s_lo);
        sc[r][1] = __halves2bfloat162(s_hi, s_hi);
      }
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {  // MMA jj: elements 4jj..4jj+3 (bytes 2jj, 2jj+1)
        const uint32_t* wa32 = reinterpret_cast<const uint32_t*>(&cw[u][0]);
        const uint32_t* wb32 = reinterpret_cast<const uint32_t*>(&cw[u][1]);
        const int sh = 16 * (jj & 1);
        uint32_t a[4];
        e2m1x4_to_bf16((wa32[jj >> 1] >> sh) & 0xffffu, a[0], a[2]);
        e2m1x4_to_bf16((wb32[jj >> 1] >> sh) & 0xffffu, a[1], a[3]);
        const int half = jj >> 2;  // elements 0-15 / 16-31 of the chunk: NVFP4 block
        a[0] = bf16x2_mul(a[0], sc[0][half]);
        a[2] = bf16x2_mul(a[2], sc[0][half]);
        a[1] = bf16x2_mul(a[1], sc[1][half]);
        a[3] = bf16x2_mul(a[3], sc[1][half]);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint32_t* x32 = reinterpret_cast<const uint32_t*>(&av[u][j][jj >> 1]);
          fi::mma_16816<__nv_bfloat16>(acc[j], a, x32[2 * (jj & 1)], x32[2 * (jj & 1) + 1]);
        }
      }
    }
  }

#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) red[warp][j * 4 + c][lane] = acc[j][c];
  __syncthreads();
  if (warp != 0) return;
  const float alpha = p.alpha != nullptr ? *p.alpha : 1.f;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v += red[w][j * 4 + c][lane];
      // c0, c1: W row g, tokens 2t, 2t + 1; c2, c3: row g + 8
      const int64_t row = (c < 2) ? row_a : row_b;
      const int tok = j * 8 + 2 * t + (c & 1);
      if (row < p.n && tok < p.m) p.out[int64_t(tok) * p.ldo + row] = from_f32<TD>(v * alpha);
    }
}

// K steps in flight per warp at M <= 8 (at M <= 16 two: 16 registers of activations per step and
// token tile). sm_80's ptxas spills 16 bytes at 4 (sm_90a's fits 4 in its 128 registers).
#ifndef FI_GEMV_FP4_U1
#define FI_GEMV_FP4_U1 (FI_TARGET_CC >= 90 ? 4 : 3)
#endif

template <int NT, bool UE8M0>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  constexpr int U = NT == 1 ? FI_GEMV_FP4_U1 : 2;
  const dim3 grid(unsigned((p.n + 15) / 16));
  gemv_fp4_kernel<NT, U, UE8M0><<<grid, kWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

// out [m, n] (row stride ldo), act [m, k] bf16 (row stride lda, 16-byte aligned rows), w [n, k / 2]
// codes (row stride ldw bytes, 16-byte aligned rows), w_sf W's scale bytes in the 128x4 layout,
// alpha a device float or null; block 16 (e4m3 scales) or 32 (ue8m0 = 1). m <= 16, k % 32 == 0.
FI_EXPORT int fi_gemv_fp4(void* out, const void* act, const void* w, const void* w_sf, const void* alpha,
                          int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldw, int64_t ldo,
                          int64_t block, int64_t ue8m0, cudaStream_t stream) {
  if (m < 0 || m > 16 || k % 32 != 0 || lda % 8 != 0 || ldw % 16 != 0 || n >= (int64_t(1) << 31) ||
      k >= (int64_t(1) << 31) || (reinterpret_cast<uintptr_t>(act) & 15) != 0 ||
      (reinterpret_cast<uintptr_t>(w) & 15) != 0 || (ue8m0 ? block != 32 : block != 16) ||
      (n + 15) / 16 > 0x7fffffff)
    return (int)cudaErrorInvalidValue;
  if (m == 0 || n == 0) return 0;
  Params p{};
  p.out = static_cast<TD*>(out);
  p.act = static_cast<const __nv_bfloat16*>(act);
  p.w = static_cast<const uint8_t*>(w);
  p.sf = static_cast<const uint8_t*>(w_sf);
  p.alpha = static_cast<const float*>(alpha);
  p.m = int(m); p.n = int(n); p.k = int(k);
  p.lda = lda; p.ldw = ldw; p.ldo = ldo;
  p.k_tiles = int((k / block + 3) / 4);
  cudaError_t err;
  if (m <= 8)
    err = ue8m0 ? launch<1, true>(p, stream) : launch<1, false>(p, stream);
  else
    err = ue8m0 ? launch<2, true>(p, stream) : launch<2, false>(p, stream);
  return (int)err;
}
