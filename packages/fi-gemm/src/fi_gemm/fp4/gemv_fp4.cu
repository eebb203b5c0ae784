// FP4 weight-streaming GEMM for decode shapes (M <= 16): out[m, n] = alpha * sum_k A[m, k] W[n, k]
// with A and W packed e2m1 ([m, k / 2] and [n, k / 2] bytes) and their block scales (W: 128x4
// layout, A: 128x4 or 8x4). At M <= 16 the GEMM is a pass over W, so reading W packed (0.5 byte
// per weight plus 1/16 or 1/32 of a scale byte) instead of as a bf16 copy (2 bytes, written by a
// dequantiser first) is what makes FP4 pay on Hopper.
//
// Tensor cores without FP4 support: each thread expands its codes in registers with the block scale
// folded in, NVFP4 to fp16 by bit placement (FI_GEMV_FP4_F16 below), MXFP4 to bf16 through byte
// tables (code * scale is exact in either, see dequant.cu), and feeds m16n8k16 MMAs, W as the MMA's
// 16-row A operand, the tokens as its 8-column B operand, fp32 accumulators.
// Thread (g = lane / 4, t = lane % 4) of a warp loads 16 bytes (32 codes) of W rows g and g + 8 at
// k0 = 128 * step + 32 * t, and the same 32 codes of token g (and g + 8 when M > 8). Its
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
#include "fi/vec.cuh"
#include "fp4.cuh"

#ifndef FI_TD
#define FI_TD __nv_bfloat16
#endif

namespace {

using TD = FI_TD;
constexpr int kWarps = 8;

struct Params {
  TD* out;                    // [m, n], row stride ldo
  const uint8_t* act;         // [m, k / 2], row stride lda bytes
  const uint8_t* act_sf;      // A's scale bytes, 128x4 or 8x4 layout (act_8x4)
  const uint8_t* w;           // [n, k / 2], row stride ldw bytes
  const uint8_t* sf;          // W's scale bytes, 128x4 layout
  const float* alpha;         // one value, or null (1)
  int m, n, k;
  int64_t lda, ldw, ldo;
  int k_tiles;                // ceil(k / block / 4): 4-column tiles of the scale layouts
  int act_8x4;
};

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
  return __float2bfloat16_rn(fi_fp4::e4m3_to_float(byte));  // exact: e4m3 fits bf16
}

// Codes 4jj..4jj+3 of a 16-byte chunk (bytes 2jj, 2jj + 1) as two bf16x2 words times the scale
// of their block: {elements 4jj, 4jj+1} and {4jj+2, 4jj+3}, the a0 / a2 (b0 / b1) fragment
// words of MMA jj.
FI_DEVICE void expand4(const uint4& chunk, int jj, __nv_bfloat162 s, uint32_t& w01, uint32_t& w23) {
  const uint32_t* c32 = reinterpret_cast<const uint32_t*>(&chunk);
  e2m1x4_to_bf16((c32[jj >> 1] >> (16 * (jj & 1))) & 0xffffu, w01, w23);
  w01 = bf16x2_mul(w01, s);
  w23 = bf16x2_mul(w23, s);
}

// Block scales of a chunk as bf16x2 pairs: [0] for codes 0-15, [1] for 16-31 (MXFP4: one scale).
template <bool UE8M0>
FI_DEVICE void chunk_scales(uint32_t bytes, __nv_bfloat162 (&sc)[2]) {
  const __nv_bfloat16 lo = scale_bf16<UE8M0>(bytes & 0xffu);
  const __nv_bfloat16 hi = UE8M0 ? lo : scale_bf16<UE8M0>(bytes >> 8);
  sc[0] = __halves2bfloat162(lo, lo);
  sc[1] = __halves2bfloat162(hi, hi);
}

// FI_GEMV_FP4_F16 (NVFP4 only; on by default, 0 builds the bf16 tables for A/B runs): expand to
// fp16 by bit placement, x1.31-1.38 over the tables on an H100 (session 44, tools/ab_fp4.py). A
// code's exponent and mantissa bits shifted into an fp16's (e at bits 10-11, m at bit 9) read as
// code * 2^-14 for every code (e = 0 lands on fp16 subnormals 0 and 2^-15), its sign bit moves to
// bit 15; two codes four apart share one shift pair (about 2 instructions per code). The
// scale goes in times 2^7, which keeps every product exact in fp16 (from 2^-22 for the smallest
// code and e4m3 scale up to 21 for the largest); the epilogue multiplies by 2^14 (both operands'
// 2^-14 * 2^7). The pairs (i, i + 4) are the fragment words of both operands alike, which the
// MMA's indifference to the order of k allows (see the top of this file).
#ifndef FI_GEMV_FP4_F16
#define FI_GEMV_FP4_F16 1
#endif

template <int I>  // codes I and I + 4 of a word -> one f16x2 word (times 2^-14)
FI_DEVICE uint32_t e2m1_pair_to_f16(uint32_t x) {
  constexpr int kEm = 9 - 4 * I, kSign = 12 - 4 * I;
  const uint32_t em = kEm >= 0 ? (x << kEm) : (x >> -kEm);
  return (em & 0x0e000e00u) | ((x << kSign) & 0x80008000u);
}

FI_DEVICE uint32_t f16x2_mul(uint32_t x, __half2 s) {
  __half2 v = *reinterpret_cast<__half2*>(&x);
  v = __hmul2(v, s);
  return *reinterpret_cast<uint32_t*>(&v);
}

// MMA jj's four codes of a chunk in fp16: pairs (0, 4), (1, 5) of word jj / 2 for even jj, (2, 6),
// (3, 7) for odd jj.
FI_DEVICE void expand4_f16(const uint4& chunk, int jj, __half2 s, uint32_t& w0, uint32_t& w1) {
  const uint32_t x = reinterpret_cast<const uint32_t*>(&chunk)[jj >> 1];
  if (jj & 1) {
    w0 = f16x2_mul(e2m1_pair_to_f16<2>(x), s);
    w1 = f16x2_mul(e2m1_pair_to_f16<3>(x), s);
  } else {
    w0 = f16x2_mul(e2m1_pair_to_f16<0>(x), s);
    w1 = f16x2_mul(e2m1_pair_to_f16<1>(x), s);
  }
}

// Two e4m3 scale bytes (low: codes 0-15) as f16x2 pairs times 2^7.
FI_DEVICE void chunk_scales_f16(uint32_t bytes, __half2 (&sc)[2]) {
  sc[0] = __float2half2_rn(fi_fp4::e4m3_to_float(bytes & 0xffu) * 128.f);
  sc[1] = __float2half2_rn(fi_fp4::e4m3_to_float(bytes >> 8) * 128.f);
}

// The two expansions as one policy for the kernel: bf16 tables (MXFP4; NVFP4 when FI_GEMV_FP4_F16
// is 0) or fp16 bit placement (NVFP4 by default), with the MMA type and the epilogue factor.
template <bool F16, bool UE8M0> struct Expand {
  using T = __nv_bfloat16;
  using S = __nv_bfloat162;
  static constexpr float kOut = 1.f;
  static FI_DEVICE void scales(uint32_t bytes, S (&sc)[2]) { chunk_scales<UE8M0>(bytes, sc); }
  static FI_DEVICE void codes(const uint4& c, int jj, S s, uint32_t& w0, uint32_t& w1) { expand4(c, jj, s, w0, w1); }
};
template <> struct Expand<true, false> {
  using T = __half;
  using S = __half2;
  static constexpr float kOut = 16384.f;  // 2^14: both operands' 2^-14 * 2^7
  static FI_DEVICE void scales(uint32_t bytes, S (&sc)[2]) { chunk_scales_f16(bytes, sc); }
  static FI_DEVICE void codes(const uint4& c, int jj, S s, uint32_t& w0, uint32_t& w1) {
    expand4_f16(c, jj, s, w0, w1);
  }
};

// The scale bytes of one thread's 32-code chunk at column c: NVFP4 two (c, c + 1: low, high
// byte), MXFP4 one.
template <bool UE8M0>
FI_DEVICE uint32_t load_scales(const uint8_t* sf, int64_t off) {
  if (UE8M0) return uint32_t(__ldg(sf + off));
  return uint32_t(__ldg(reinterpret_cast<const uint16_t*>(sf + off)));
}

// NT: 8-token MMA column tiles (1: M <= 8, 2: M <= 16). U: K steps in flight per warp.
// UE8M0: MXFP4 (one scale per 32 codes, i.e. per thread and step) instead of NVFP4 (two).
template <int NT, int U, bool UE8M0>
__global__ void __launch_bounds__(kWarps * 32, 2) gemv_fp4_kernel(const Params p) {
  using E = Expand<FI_GEMV_FP4_F16 != 0 && !UE8M0, UE8M0>;
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
    uint4 cw[U][2], ca[U][NT];   // 32 codes of W rows g, g + 8 and of tokens g (+ 8)
    uint32_t sw[U][2], sa[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u * kWarps;
      const int k0 = s * 128 + t * 32;
      const bool ok = s < steps && k0 < p.k;  // k is a multiple of 32: a chunk is whole or absent
      const int c = UE8M0 ? k0 >> 5 : k0 >> 4;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      cw[u][0] = ok && va ? fi::load16_stream(wa + k0 / 2) : zero;  // W is read once
      cw[u][1] = ok && vb ? fi::load16_stream(wb + k0 / 2) : zero;
      sw[u][0] = ok && va ? load_scales<UE8M0>(p.sf, fi_fp4::sf_offset_128x4(row_a, c, p.k_tiles)) : 0u;
      sw[u][1] = ok && vb ? load_scales<UE8M0>(p.sf, fi_fp4::sf_offset_128x4(row_b, c, p.k_tiles)) : 0u;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int tok = j * 8 + g;
        const bool okt = ok && tok < p.m;
        ca[u][j] = okt ? load_cached(p.act + int64_t(tok) * p.lda + k0 / 2) : zero;
        sa[u][j] = okt ? load_scales<UE8M0>(p.act_sf, p.act_8x4 ? fi_fp4::sf_offset_8x4(tok, c, p.k_tiles)
                                                                : fi_fp4::sf_offset_128x4(tok, c, p.k_tiles))
                       : 0u;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      typename E::S scw[2][2], sca[NT][2];
      E::scales(sw[u][0], scw[0]);
      E::scales(sw[u][1], scw[1]);
#pragma unroll
      for (int j = 0; j < NT; ++j) E::scales(sa[u][j], sca[j]);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {  // MMA jj: codes 4jj..4jj+3 of every chunk
        const int half = jj >> 2;       // codes 0-15 / 16-31: the NVFP4 block
        uint32_t a[4];
        E::codes(cw[u][0], jj, scw[0][half], a[0], a[2]);
        E::codes(cw[u][1], jj, scw[1][half], a[1], a[3]);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          uint32_t b0, b1;
          E::codes(ca[u][j], jj, sca[j][half], b0, b1);
          fi::mma_16816<typename E::T>(acc[j], a, b0, b1);
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
  const float alpha = (p.alpha != nullptr ? *p.alpha : 1.f) * E::kOut;
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
      if (row < p.n && tok < p.m) p.out[int64_t(tok) * p.ldo + row] = fi::from_float<TD>(v * alpha);
    }
}

// K steps in flight per warp at M <= 8 (U1) and M <= 16 (U2).
#ifndef FI_GEMV_FP4_U1
#define FI_GEMV_FP4_U1 4
#endif
#ifndef FI_GEMV_FP4_U2
#define FI_GEMV_FP4_U2 2
#endif

template <int NT, bool UE8M0>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  constexpr int U = NT == 1 ? FI_GEMV_FP4_U1 : FI_GEMV_FP4_U2;
  const dim3 grid(unsigned((p.n + 15) / 16));
  gemv_fp4_kernel<NT, U, UE8M0><<<grid, kWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

// out [m, n] (row stride ldo); act [m, k / 2] and w [n, k / 2] codes (row strides lda / ldw bytes,
// 16-byte aligned rows); act_sf / w_sf their scale bytes (w: 128x4 layout; act: 128x4, or 8x4
// when act_8x4), 2-byte aligned for NVFP4; alpha a device float or null; block 16 (e4m3 scales)
// or 32 (ue8m0 = 1). m <= 16, k % 32 == 0.
FI_EXPORT int fi_gemv_fp4(void* out, const void* act, const void* act_sf, const void* w, const void* w_sf,
                          const void* alpha, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldw,
                          int64_t ldo, int64_t block, int64_t ue8m0, int64_t act_8x4, cudaStream_t stream) {
  const uintptr_t align16 = reinterpret_cast<uintptr_t>(act) | reinterpret_cast<uintptr_t>(w);
  const uintptr_t align2 = reinterpret_cast<uintptr_t>(act_sf) | reinterpret_cast<uintptr_t>(w_sf);
  if (m < 0 || m > 16 || k % 32 != 0 || lda % 16 != 0 || ldw % 16 != 0 || n >= (int64_t(1) << 31) ||
      k >= (int64_t(1) << 31) || (align16 & 15) != 0 || (!ue8m0 && (align2 & 1) != 0) ||
      (ue8m0 ? block != 32 : block != 16))
    return (int)cudaErrorInvalidValue;
  if (m == 0 || n == 0) return 0;
  Params p{};
  p.out = static_cast<TD*>(out);
  p.act = static_cast<const uint8_t*>(act);
  p.act_sf = static_cast<const uint8_t*>(act_sf);
  p.w = static_cast<const uint8_t*>(w);
  p.sf = static_cast<const uint8_t*>(w_sf);
  p.alpha = static_cast<const float*>(alpha);
  p.m = int(m); p.n = int(n); p.k = int(k);
  p.lda = lda; p.ldw = ldw; p.ldo = ldo;
  p.k_tiles = int((k / block + 3) / 4);
  p.act_8x4 = act_8x4 != 0;
  cudaError_t err;
  if (m <= 8)
    err = ue8m0 ? launch<1, true>(p, stream) : launch<1, false>(p, stream);
  else
    err = ue8m0 ? launch<2, true>(p, stream) : launch<2, false>(p, stream);
  return (int)err;
}
