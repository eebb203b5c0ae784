// Rotary position embedding (RoPE) for q and k in one pass: NeoX (rotate halves) and GPT-J
// (rotate even/odd pairs), partial rotary_dim, positions from pos_ids or from (indptr, offsets),
// angles computed in the kernel (plain or Llama 3.1 frequency smoothing) or read from a
// precomputed float32 cos/sin cache. Element type FI_T comes from the spec (one per module).
//
// Work split. A "lane" owns VEC rotation pairs of one head (NeoX: elements [f0, f0+VEC) and
// [half+f0, half+f0+VEC); GPT-J: the 2*VEC elements from 2*f0), so every element is read once
// and written once with up to 16-byte accesses: no re-read of the partner half. A thread is one
// (token, head group, lane): it derives its VEC angles once and applies them to every head of its
// group (q heads then k heads), kBatch heads' loads in flight at a time. Out-of-place calls also
// have "tail" lanes that copy the elements past rotary_dim.
//
// Cos/sin cache. Angles read from the cache need no setup math, so that path has its own kernels
// built for bytes in flight: an item (a token, a group of kCacheHeads heads, a lane) issues the
// loads of all its heads before it waits on anything (the token's position included), then reads
// the cache row that depends on the position, then rotates and stores. The default streaming
// kernel keeps the next item's loads in flight while it finishes the current one.
// FI_ROPE_CACHE_VARIANT picks the kernel (below).
//
// Accuracy. Frequencies are evaluated in fp64 and rounded once to fp32, and the angle is the fp32
// product float(pos) * freq, which the fp32 reference reproduces bit for bit. The angle is then
// reduced modulo 2*pi in fp64 before the fp32 sincosf, so positions up to 2^24 keep full fp32
// accuracy (a fp32 reduction of pos * freq ~ 1e6 would lose ~7 bits).
#include <type_traits>

#include "fi/common.cuh"
#include "fi/vec.cuh"

#ifndef FI_T
#error "FI_T (element type) must be defined by the spec"
#endif
// Cos/sin-cache path, a tuning define (the apply_rope_with_cos_sin_cache_inplace bench routine's
// option variant=N and tools/ab_memops.py build a module with another value for A/B runs):
//   0: the computed-angle kernel with a cache row (two batches of 2 heads, L2 prefetch of the
//      second; 78 registers on sm_90a for bf16: 3 blocks, 768 threads per SM, 64 B of loads per
//      thread), the behaviour before the dedicated kernels;
//   1: rope_cache_kernel, one item per thread (a token, 4 heads, a lane), at most 64 registers
//      (4 blocks, 1024 threads per SM, 128 B of loads per thread issued at once); the default
//      until session 42;
//   7: rope_cache_stream_kernel (the default): resident blocks, 3 per SM at most 85 registers,
//      whose threads walk items of 2 heads with the next item's loads in flight while the
//      current one rotates and stores; 16-byte q/k loads and stores carry an L2 evict-first
//      policy.
// tools/ab_memops.py, 7 against 1 in turns on an H100 (results/h100/rope_ab_session42_*.json):
// 8192 tokens x1.014, 2048 x1.042, 256 x1.143, 64 x1.284, 1 x1.061. Measured there and removed:
// the streaming kernel without the policy (x0.995 at 8192 tokens, x1.06 at 256), the policy on 1
// (x1.016; on its stores alone x1.015, on its loads alone x1.000), streaming items of 4 heads
// (x0.980); in session 2, 2 or 8 heads per thread in 1 (47.5 / 46.9 us against 45.6).
#ifndef FI_ROPE_CACHE_VARIANT
#define FI_ROPE_CACHE_VARIANT 7
#endif
#if FI_ROPE_CACHE_VARIANT != 0 && FI_ROPE_CACHE_VARIANT != 1 && FI_ROPE_CACHE_VARIANT != 7
#error "FI_ROPE_CACHE_VARIANT must be 0, 1 or 7"
#endif

namespace {

using T = FI_T;

constexpr int kThreads = 256;
// Heads per thread whose loads are issued before the first store: 64 bytes in flight per thread
// for 16-byte runs, and few enough registers for 3 resident blocks per SM.
template <int VEC>
constexpr int kBatch = VEC >= 8 ? 2 : 4;
constexpr int kPrefetch = 2;  // batches of heads prefetched into L2 ahead of their loads

// The cache kernels: heads per item (0: the cache path uses rope_kernel), the streaming form,
// whether q/k accesses carry the evict-first policy, and the minimum resident blocks of kThreads
// that __launch_bounds__ asks for, which caps the registers at 65536 / (kThreads * blocks) (64
// for 4 blocks, 85 for 3).
constexpr int kCacheHeads = FI_ROPE_CACHE_VARIANT == 0 ? 0 : FI_ROPE_CACHE_VARIANT == 1 ? 4 : 2;
constexpr bool kCacheStream = FI_ROPE_CACHE_VARIANT == 7;
constexpr bool kEvictFirst = FI_ROPE_CACHE_VARIANT == 7;
constexpr int kCacheMinBlocks = kCacheStream ? 3 : 4;

struct RopeParams {
  const T* q;
  const T* k;
  T* q_out;
  T* k_out;
  int64_t q_sn, q_sh, k_sn, k_sh;      // input strides (elements): token, head
  int64_t qo_sn, qo_sh, ko_sn, ko_sh;  // output strides
  const void* pos;                     // pos_ids [nnz], or offsets [batch] when indptr != null
  const void* indptr;                  // [batch + 1] or null
  const float* cos_sin;                // [max_pos, 2 * half] or null (angles computed)
  int64_t nnz;
  int64_t max_pos;
  int batch;
  int hq, hk;
  int half;       // rotary_dim / 2
  int rot_lanes;  // half / VEC
  int lanes;      // rot_lanes + tail-copy lanes
  int heads_per_thread;
  int groups;
  bool pos64, indptr64;
  bool llama;
  double theta, rcp_scale, smooth_a, smooth_b;
};

FI_DEVICE int64_t load_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Position of token t. With indptr: request b = the last one with indptr[b] <= t (so empty
// requests are skipped), position = offsets[b] + t - indptr[b].
FI_DEVICE int64_t token_position(const RopeParams& p, int64_t t) {
  if (p.indptr == nullptr) return load_index(p.pos, p.pos64, t);
  int lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (load_index(p.indptr, p.indptr64, mid) <= t) lo = mid; else hi = mid - 1;
  }
  return load_index(p.pos, p.pos64, lo) + t - load_index(p.indptr, p.indptr64, lo);
}

// Frequency of pair i in fp64 (explicit _rn ops: no FMA contraction, so the host reference in
// float64 gets the same double and hence the same fp32 rounding).
FI_DEVICE float pair_frequency(const RopeParams& p, int i) {
  const double e = __ddiv_rn(-2.0 * i, 2.0 * p.half);
  const double f = pow(p.theta, e);
  const double scaled = __dmul_rn(f, p.rcp_scale);
  if (!p.llama) return __double2float_rn(scaled);
  double s = __dadd_rn(__dmul_rn(f, p.smooth_a), p.smooth_b);
  s = fmin(fmax(s, 0.0), 1.0);
  return __double2float_rn(__dadd_rn(__dmul_rn(1.0 - s, scaled), __dmul_rn(s, f)));
}

// sin/cos of a fp32 angle up to ~2^24 in magnitude: exact-enough fp64 reduction to [-pi, pi]
// (2*pi split in two doubles), then the accurate fp32 sincosf on its fast path.
FI_DEVICE void sincos_reduced(float angle, float* s, float* c) {
  constexpr double kInv2Pi = 0.15915494309189535;
  constexpr double k2PiHi = 6.283185307179586;
  constexpr double k2PiLo = 2.4492935982947064e-16;
  const double a = angle;
  const double n = rint(a * kInv2Pi);
  double r = fma(-n, k2PiHi, a);
  r = fma(-n, k2PiLo, r);
  sincosf(__double2float_rn(r), s, c);
}

// Cache row reads. READ_ONLY: through the non-coherent read-only path (ld.global.nc), which keeps
// the row in L1 for the other head groups of the token; the cache is never written by the kernel.
template <bool READ_ONLY>
FI_DEVICE float4 load_f4(const float* ptr) {
  if constexpr (READ_ONLY) return __ldg(reinterpret_cast<const float4*>(ptr));
  return *reinterpret_cast<const float4*>(ptr);
}

template <bool READ_ONLY>
FI_DEVICE float load_f1(const float* ptr) {
  if constexpr (READ_ONLY) return __ldg(ptr);
  return *ptr;
}

template <int VEC, bool READ_ONLY = false>
FI_DEVICE void load_cos_sin(const RopeParams& p, int64_t pos, int f0, float (&c)[VEC], float (&s)[VEC]) {
  if (pos < 0 || pos >= p.max_pos) {
    // Out-of-range position: NaN outputs instead of an out-of-bounds read or a silent answer.
#pragma unroll
    for (int i = 0; i < VEC; ++i) c[i] = s[i] = __int_as_float(0x7fc00000);
    return;
  }
  const float* row = p.cos_sin + pos * (2 * (int64_t)p.half);
  if constexpr (VEC % 4 == 0) {  // launcher guarantees 16-byte alignment for this case
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      const float4 cv = load_f4<READ_ONLY>(row + f0 + i);
      const float4 sv = load_f4<READ_ONLY>(row + p.half + f0 + i);
      c[i] = cv.x; c[i + 1] = cv.y; c[i + 2] = cv.z; c[i + 3] = cv.w;
      s[i] = sv.x; s[i + 1] = sv.y; s[i + 2] = sv.z; s[i + 3] = sv.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      c[i] = load_f1<READ_ONLY>(row + f0 + i);
      s[i] = load_f1<READ_ONLY>(row + p.half + f0 + i);
    }
  }
}

FI_DEVICE void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

// VEC elements (VEC even) held as VEC/2 packed 32-bit words. The compiler splits a vec_t of 16-bit
// elements into one register per element (4 heads of 16-byte bf16 runs then spilled 112 B under
// the 64-register cap); packed words keep a 16-byte run in 4 registers, and the rotation unpacks
// one word at a time.
template <int VEC>
struct Packed {
  static_assert(VEC % 2 == 0 && VEC * sizeof(T) <= 16, "Packed holds 2 to 8 elements of 2 bytes");
  static constexpr int kWords = VEC / 2;
  uint32_t w[kWords];

  // q/k runs are read exactly once: no L1 allocation, which leaves L1 to the cache rows that every
  // head group of a token re-reads. Coherent (not .nc): in-place calls store to these addresses.
  FI_DEVICE void load_no_l1(const T* ptr) {
    if constexpr (kEvictFirst && kWords == 4) {
      const uint4 r = fi::load16_evict_first(ptr);
      w[0] = r.x; w[1] = r.y; w[2] = r.z; w[3] = r.w;
    } else if constexpr (kWords == 4) {
      asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(ptr));
    } else if constexpr (kWords == 2) {
      asm volatile("ld.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(ptr));
    } else {
      asm volatile("ld.global.L1::no_allocate.u32 %0, [%1];" : "=r"(w[0]) : "l"(ptr));
    }
  }

  FI_DEVICE void store(T* ptr) const {
    if constexpr (kEvictFirst && kWords == 4)
      fi::store16_evict_first(ptr, make_uint4(w[0], w[1], w[2], w[3]));
    else if constexpr (kWords == 4) *reinterpret_cast<uint4*>(ptr) = make_uint4(w[0], w[1], w[2], w[3]);
    else if constexpr (kWords == 2) *reinterpret_cast<uint2*>(ptr) = make_uint2(w[0], w[1]);
    else *reinterpret_cast<uint32_t*>(ptr) = w[0];
  }
};

// The two elements of a packed word as floats (low half first), and back with round-to-nearest.
FI_DEVICE float2 unpack2(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
}

FI_DEVICE uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// rotate_pairs on packed runs, one word (NeoX: one word of a and one of b) at a time.
template <bool INTERLEAVE, int VEC>
FI_DEVICE void rotate_packed(Packed<VEC>& a, Packed<VEC>& b, const float (&c)[VEC],
                             const float (&s)[VEC]) {
  constexpr int kW = Packed<VEC>::kWords;
#pragma unroll
  for (int k = 0; k < kW; ++k) {
    const float2 x = unpack2(a.w[k]), y = unpack2(b.w[k]);
    if constexpr (INTERLEAVE) {  // pair i = word i of a ++ b: (low, high)
      a.w[k] = pack2(x.x * c[k] - x.y * s[k], x.y * c[k] + x.x * s[k]);
      b.w[k] = pack2(y.x * c[kW + k] - y.y * s[kW + k], y.y * c[kW + k] + y.x * s[kW + k]);
    } else {  // pairs 2k and 2k + 1: (low of a, low of b) and (high of a, high of b)
      const int i = 2 * k;
      a.w[k] = pack2(x.x * c[i] - y.x * s[i], x.y * c[i + 1] - y.y * s[i + 1]);
      b.w[k] = pack2(y.x * c[i] + x.x * s[i], y.y * c[i + 1] + x.y * s[i + 1]);
    }
  }
}

FI_DEVICE const T* head_in(const RopeParams& p, int64_t t, int h) {
  return h < p.hq ? p.q + t * p.q_sn + h * p.q_sh : p.k + t * p.k_sn + (h - p.hq) * p.k_sh;
}

FI_DEVICE T* head_out(const RopeParams& p, int64_t t, int h) {
  return h < p.hq ? p.q_out + t * p.qo_sn + h * p.qo_sh
                  : p.k_out + t * p.ko_sn + (h - p.hq) * p.ko_sh;
}

// Rotate the VEC pairs held in the runs a and b (NeoX: (a[i], b[i]); GPT-J: adjacent elements of
// a ++ b), converting one pair at a time so no float copy of the runs stays live.
template <bool INTERLEAVE, int VEC>
FI_DEVICE void rotate_pairs(fi::vec_t<T, VEC>& a, fi::vec_t<T, VEC>& b, const float (&c)[VEC],
                            const float (&s)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const int ix = INTERLEAVE ? 2 * i : i;
    const int iy = INTERLEAVE ? 2 * i + 1 : VEC + i;
    T& X = ix < VEC ? a[ix] : b[ix - VEC];
    T& Y = iy < VEC ? a[iy] : b[iy - VEC];
    const float x = fi::to_float(X), y = fi::to_float(Y);
    X = fi::from_float<T>(x * c[i] - y * s[i]);
    Y = fi::from_float<T>(y * c[i] + x * s[i]);
  }
}

template <bool INTERLEAVE, int VEC>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeParams p) {
  extern __shared__ float s_freq[];  // [half], only when angles are computed
  if (p.cos_sin == nullptr) {
    for (int i = threadIdx.x; i < p.half; i += kThreads) s_freq[i] = pair_frequency(p, i);
    __syncthreads();
  }
  const int64_t item = blockIdx.x * (int64_t)kThreads + threadIdx.x;
  const int64_t per_token = (int64_t)p.groups * p.lanes;
  const int64_t t = item / per_token;
  if (t >= p.nnz) return;
  const int rem = static_cast<int>(item - t * per_token);
  const int g = rem / p.lanes;
  const int lane = rem - g * p.lanes;
  const int h_begin = g * p.heads_per_thread;
  const int h_end = min(h_begin + p.heads_per_thread, p.hq + p.hk);

  if (lane >= p.rot_lanes) {
    // Tail copy (out-of-place only): elements [rotary_dim, head_dim) pass through unchanged.
    const int off = 2 * p.half + (lane - p.rot_lanes) * VEC;
    for (int h = h_begin; h < h_end; h += kBatch<VEC>) {
      fi::vec_t<T, VEC> x[kBatch<VEC>];
#pragma unroll
      for (int j = 0; j < kBatch<VEC>; ++j)
        if (h + j < h_end) x[j].load(head_in(p, t, h + j) + off);
#pragma unroll
      for (int j = 0; j < kBatch<VEC>; ++j)
        if (h + j < h_end) x[j].store(head_out(p, t, h + j) + off);
    }
    return;
  }

  const int f0 = lane * VEC;  // first pair (= frequency index) of this lane
  float c[VEC], s[VEC];
  const int64_t pos = token_position(p, t);
  if (p.cos_sin != nullptr) {
    load_cos_sin<VEC>(p, pos, f0, c, s);
  } else {
    const float fpos = __ll2float_rn(pos);
#pragma unroll
    for (int i = 0; i < VEC; ++i) sincos_reduced(__fmul_rn(fpos, s_freq[f0 + i]), &s[i], &c[i]);
  }

  // Two VEC-element runs per head: NeoX pairs (a[i], b[i]); GPT-J pairs are adjacent elements of
  // the 2*VEC-long run a ++ b.
  const int off_a = INTERLEAVE ? 2 * f0 : f0;
  const int off_b = INTERLEAVE ? 2 * f0 + VEC : f0 + p.half;
  // Loads cannot move above the previous heads' stores (in-place calls alias them), so only
  // kBatch heads are in registers at a time; L2 prefetches kPrefetch batches ahead keep more
  // bytes in flight per thread without costing registers.
  for (int hp = h_begin + kBatch<VEC>; hp < min(h_begin + kPrefetch * kBatch<VEC>, h_end); ++hp) {
    prefetch_l2(head_in(p, t, hp) + off_a);  // prologue: the batches before the first prefetch
    prefetch_l2(head_in(p, t, hp) + off_b);
  }
#pragma unroll 1
  for (int h = h_begin; h < h_end; h += kBatch<VEC>) {
#pragma unroll
    for (int j = 0; j < kBatch<VEC>; ++j) {
      const int hp = h + kPrefetch * kBatch<VEC> + j;
      if (hp < h_end) {
        const T* src = head_in(p, t, hp);
        prefetch_l2(src + off_a);
        prefetch_l2(src + off_b);
      }
    }
    fi::vec_t<T, VEC> a[kBatch<VEC>], b[kBatch<VEC>];
#pragma unroll
    for (int j = 0; j < kBatch<VEC>; ++j) {
      if (h + j < h_end) {
        const T* src = head_in(p, t, h + j);
        a[j].load(src + off_a);
        b[j].load(src + off_b);
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch<VEC>; ++j) {
      if (h + j >= h_end) continue;
      rotate_pairs<INTERLEAVE, VEC>(a[j], b[j], c, s);
      T* dst = head_out(p, t, h + j);
      a[j].store(dst + off_a);
      b[j].store(dst + off_b);
    }
  }
}

// A work item of the cos/sin-cache kernels: one (token, group of HEADS heads, lane), like
// rope_kernel's thread, with its loads ordered for latency. load(): the position load, then the
// loads of all its heads (they do not depend on the position, and nothing is stored yet, so
// in-place aliasing cannot hold them back). finish(): the cache row (which waited on the position
// while the head loads were in flight), then the rotations and stores.
template <bool INTERLEAVE, int VEC, int HEADS>
struct CacheItem {
  int64_t t = 0, pos = 0;
  int h0 = 0, n = 0, lane = 0;
  Packed<VEC> a[HEADS], b[HEADS];

  FI_DEVICE void load(const RopeParams& p, int64_t item) {
    const int64_t per_token = (int64_t)p.groups * p.lanes;
    t = item / per_token;
    const int rem = static_cast<int>(item - t * per_token);
    const int g = rem / p.lanes;
    lane = rem - g * p.lanes;
    h0 = g * HEADS;
    n = min(HEADS, p.hq + p.hk - h0);
    if (lane >= p.rot_lanes) {  // tail copy (out-of-place only)
      const int off = 2 * p.half + (lane - p.rot_lanes) * VEC;
#pragma unroll
      for (int j = 0; j < HEADS; ++j)
        if (j < n) a[j].load_no_l1(head_in(p, t, h0 + j) + off);
      return;
    }
    pos = token_position(p, t);
    const int f0 = lane * VEC;
    const int off_a = INTERLEAVE ? 2 * f0 : f0;
    const int off_b = INTERLEAVE ? 2 * f0 + VEC : f0 + p.half;
#pragma unroll
    for (int j = 0; j < HEADS; ++j) {
      if (j < n) {
        const T* src = head_in(p, t, h0 + j);
        a[j].load_no_l1(src + off_a);
        b[j].load_no_l1(src + off_b);
      }
    }
  }

  FI_DEVICE void finish(const RopeParams& p) {
    if (lane >= p.rot_lanes) {
      const int off = 2 * p.half + (lane - p.rot_lanes) * VEC;
#pragma unroll
      for (int j = 0; j < HEADS; ++j)
        if (j < n) a[j].store(head_out(p, t, h0 + j) + off);
      return;
    }
    const int f0 = lane * VEC;
    const int off_a = INTERLEAVE ? 2 * f0 : f0;
    const int off_b = INTERLEAVE ? 2 * f0 + VEC : f0 + p.half;
    float c[VEC], s[VEC];
    load_cos_sin<VEC, true>(p, pos, f0, c, s);
#pragma unroll
    for (int j = 0; j < HEADS; ++j) {
      if (j < n) {
        rotate_packed<INTERLEAVE, VEC>(a[j], b[j], c, s);
        T* dst = head_out(p, t, h0 + j);
        a[j].store(dst + off_a);
        b[j].store(dst + off_b);
      }
    }
  }
};

// Variant 1: one thread per item. The register cap (kCacheMinBlocks) keeps all HEADS heads in
// registers with more threads per SM than rope_kernel's 3 blocks.
template <bool INTERLEAVE, int VEC, int HEADS>
__global__ void __launch_bounds__(kThreads, kCacheMinBlocks) rope_cache_kernel(const RopeParams p) {
  const int64_t item = blockIdx.x * (int64_t)kThreads + threadIdx.x;
  if (item >= p.nnz * (int64_t)p.groups * p.lanes) return;
  CacheItem<INTERLEAVE, VEC, HEADS> it;
  it.load(p, item);
  it.finish(p);
}

// Variant 7, the default, the streaming form: a grid of resident blocks whose threads walk the
// items item, item + stride, ... The next item's position and head loads are issued before the
// current item's cache row is read and its heads are rotated and stored, so a thread always has a
// load round in flight. Items are disjoint, so in-place calls cannot alias across them.
template <bool INTERLEAVE, int VEC, int HEADS>
__global__ void __launch_bounds__(kThreads, kCacheMinBlocks) rope_cache_stream_kernel(const RopeParams p) {
  const int64_t total = p.nnz * (int64_t)p.groups * p.lanes;
  const int64_t stride = (int64_t)gridDim.x * kThreads;
  int64_t item = blockIdx.x * (int64_t)kThreads + threadIdx.x;
  if (item >= total) return;
  CacheItem<INTERLEAVE, VEC, HEADS> cur, nxt;
  cur.load(p, item);
  // Two copies of the loop body with the roles swapped, so no item is copied between registers.
  for (;;) {
    item += stride;
    if (item < total) nxt.load(p, item);
    cur.finish(p);
    if (item >= total) break;
    item += stride;
    if (item < total) cur.load(p, item);
    nxt.finish(p);
    if (item >= total) break;
  }
}

// Items of kCacheHeads heads. rope_cache_kernel: one thread per item, no loop (the bench shape,
// 8192 tokens, 40 heads, 8 lanes of 16-byte runs, gives 2560 blocks of 256 at 4 heads: several
// waves of short blocks). The streaming kernel: at most the resident blocks (3 per SM), each
// thread walking its items; small batches (a decode step's tokens) get one item per thread in
// fewer blocks.
template <bool INTERLEAVE, int VEC>
int launch_cache(const RopeParams& p, cudaStream_t stream) {
  constexpr int kHeads = kCacheHeads > 0 ? kCacheHeads : 1;
  RopeParams q = p;
  q.heads_per_thread = kHeads;
  q.groups = fi::ceil_div(p.hq + p.hk, kHeads);
  const int64_t items = p.nnz * p.lanes * q.groups;
  int64_t blocks = fi::ceil_div<int64_t>(items, kThreads);
  if constexpr (kCacheStream) {
    auto stream_kernel = rope_cache_stream_kernel<INTERLEAVE, VEC, kHeads>;
    static int blocks_per_sm = [&] {
      int n = 0;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, stream_kernel, kThreads, 0) != cudaSuccess) n = 2;
      return n > 0 ? n : 1;
    }();
    const int64_t resident = (int64_t)fi::sm_count() * blocks_per_sm;
    if (blocks > resident) blocks = resident;
    stream_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(q);
  } else {
    rope_cache_kernel<INTERLEAVE, VEC, kHeads><<<(unsigned)blocks, kThreads, 0, stream>>>(q);
  }
  return FI_LAUNCH_STATUS();
}

template <bool INTERLEAVE, int VEC>
int launch(const RopeParams& p, cudaStream_t stream) {
  // 2-byte runs (VEC 1: odd rotary_dim / 2 or 2-byte aligned views) keep rope_kernel.
  if constexpr (kCacheHeads > 0 && VEC >= 2) {
    if (p.cos_sin != nullptr) return launch_cache<INTERLEAVE, VEC>(p, stream);
  }
  auto kernel = rope_kernel<INTERLEAVE, VEC>;
  // Resident blocks per SM, read once per process from the occupancy calculator (registers
  // decide it), so the head grouping below fills the GPU in about one wave.
  static int blocks_per_sm = [&] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 2048) != cudaSuccess) n = 4;
    return n > 0 ? n : 1;
  }();
  RopeParams q = p;
  const int heads = p.hq + p.hk;
  const int64_t per_group = p.nnz * p.lanes;  // threads per head group
  const int64_t resident = (int64_t)fi::sm_count() * blocks_per_sm * kThreads;
  int64_t want = resident / (per_group > 0 ? per_group : 1);
  // With a cos/sin cache a thread's setup is one 64-byte row read (an L1 hit for all but the
  // first head group of a token), so short threads are cheap: at most two batches of heads each.
  // Long per-thread loops serialise (in-place loads wait for the previous batch's stores), and
  // "one wave" undershoots: 8192 tokens x 8 lanes at 3 blocks/SM (78 registers on sm_90a) gave
  // one 40-head group, 256 blocks for 396 resident slots. Ten 4-head groups give 2560 short
  // blocks. Computed angles cost VEC sincos per thread, so that path keeps long threads.
  if (p.cos_sin != nullptr) {
    const int64_t short_groups = fi::ceil_div<int64_t>(heads, 2 * kBatch<VEC>);
    if (want < short_groups) want = short_groups;
  }
  want = want < 1 ? 1 : (want > heads ? heads : want);
  q.heads_per_thread = (int)fi::ceil_div<int64_t>(heads, want);
  q.groups = fi::ceil_div(heads, q.heads_per_thread);
  const int64_t items = per_group * q.groups;
  const int64_t blocks = fi::ceil_div<int64_t>(items, kThreads);
  const size_t smem = p.cos_sin == nullptr ? sizeof(float) * p.half : 0;
  FI_TRY(fi::set_max_dynamic_smem(kernel, (int)smem));
  kernel<<<(unsigned)blocks, kThreads, smem, stream>>>(q);
  return FI_LAUNCH_STATUS();
}

template <bool INTERLEAVE>
int launch_vec(int vec, const RopeParams& p, cudaStream_t stream) {
  switch (vec) {
    case 8: if constexpr (sizeof(T) <= 2) return launch<INTERLEAVE, 8>(p, stream); break;
    case 4: return launch<INTERLEAVE, 4>(p, stream);
    case 2: return launch<INTERLEAVE, 2>(p, stream);
    default: return launch<INTERLEAVE, 1>(p, stream);
  }
  return (int)cudaErrorInvalidValue;
}

bool aligned_to(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace

// q/k: [nnz, hq|hk, head_dim] with the given strides (elements, last dim contiguous); outputs may
// alias the inputs (in-place: then the tail past rotary_dim is not touched). `pos` is pos_ids
// [nnz], or offsets [batch] when `indptr` [batch+1] is given; `cos_sin` [max_pos, rotary_dim]
// float32 replaces the computed angles when non-null. Index tensors are int32 or int64 (flags).
FI_EXPORT int fi_rope(void* q_out, void* k_out, const void* q, const void* k, int64_t nnz,
                      int64_t hq, int64_t hk, int64_t head_dim, int64_t rotary_dim, int64_t q_sn,
                      int64_t q_sh, int64_t k_sn, int64_t k_sh, int64_t qo_sn, int64_t qo_sh,
                      int64_t ko_sn, int64_t ko_sh, const void* pos, int64_t pos64,
                      const void* indptr, int64_t indptr64, int64_t batch, const void* cos_sin,
                      int64_t max_pos, int64_t interleave, double theta, double rcp_scale,
                      int64_t llama, double smooth_a, double smooth_b, cudaStream_t stream) {
  if (nnz <= 0 || hq + hk <= 0) return cudaSuccess;
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim) return (int)cudaErrorInvalidValue;
  const bool copy_tail = q_out != q && rotary_dim < head_dim;
  const int64_t half = rotary_dim / 2;

  // Widest access (<= 16 bytes) that every run start, stride and base pointer allows.
  auto fits = [&](int v) {
    const int64_t bytes = v * (int64_t)sizeof(T);
    if (half % v != 0) return false;
    if (copy_tail && (head_dim - rotary_dim) % v != 0) return false;
    const int64_t strides[] = {q_sn, q_sh, k_sn, k_sh, qo_sn, qo_sh, ko_sn, ko_sh};
    for (int64_t s : strides)
      if (s % v != 0) return false;
    const void* ptrs[] = {q, k, q_out, k_out};
    for (const void* ptr : ptrs)
      if (!aligned_to(ptr, bytes)) return false;
    if (cos_sin != nullptr && v % 4 == 0 && !aligned_to(cos_sin, 16)) return false;
    return true;
  };
  int vec = 16 / (int)sizeof(T);
  while (vec > 1 && !fits(vec)) vec /= 2;

  RopeParams p{};
  p.q = static_cast<const T*>(q);
  p.k = static_cast<const T*>(k);
  p.q_out = static_cast<T*>(q_out);
  p.k_out = static_cast<T*>(k_out);
  p.q_sn = q_sn; p.q_sh = q_sh; p.k_sn = k_sn; p.k_sh = k_sh;
  p.qo_sn = qo_sn; p.qo_sh = qo_sh; p.ko_sn = ko_sn; p.ko_sh = ko_sh;
  p.pos = pos;
  p.indptr = indptr;
  p.cos_sin = static_cast<const float*>(cos_sin);
  p.nnz = nnz;
  p.max_pos = max_pos;
  p.batch = (int)batch;
  p.hq = (int)hq;
  p.hk = (int)hk;
  p.half = (int)half;
  p.rot_lanes = (int)(half / vec);
  p.lanes = p.rot_lanes + (copy_tail ? (int)((head_dim - rotary_dim) / vec) : 0);
  p.pos64 = pos64 != 0;
  p.indptr64 = indptr64 != 0;
  p.llama = llama != 0;
  p.theta = theta;
  p.rcp_scale = rcp_scale;
  p.smooth_a = smooth_a;
  p.smooth_b = smooth_b;
  return interleave ? launch_vec<true>(vec, p, stream) : launch_vec<false>(vec, p, stream);
}
