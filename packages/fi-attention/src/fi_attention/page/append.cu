// append_paged_kv_cache: scatter new K/V rows into their pages. One CTA per appended token; its
// threads copy the token's H x D keys and values with 16-byte accesses (the op is a pure copy:
// bandwidth bound, nothing to reuse). The token's page is indices[indptr[b] + pos / page_size].
#include "fi/common.cuh"
#include "fi/vec.cuh"

namespace {

using T = FI_T;
constexpr int VEC = 16 / sizeof(T);

__global__ void __launch_bounds__(128) append_kernel(
    const T* __restrict__ key, int64_t key_st, int64_t key_sh, const T* __restrict__ value,
    int64_t val_st, int64_t val_sh, const int* __restrict__ batch_indices,
    const int* __restrict__ positions, T* k_cache, int64_t k_sp, int64_t k_st, int64_t k_sh,
    T* v_cache, int64_t v_sp, int64_t v_st, int64_t v_sh, const int* __restrict__ indices,
    const int* __restrict__ indptr, int page_size, int H, int D) {
  const int i = blockIdx.x;
  const int b = batch_indices[i], pos = positions[i];
  const int64_t page = indices[indptr[b] + pos / page_size];
  const int off = pos % page_size;
  const int vecs_per_head = D / VEC;
  for (int e = threadIdx.x; e < H * vecs_per_head; e += blockDim.x) {
    const int h = e / vecs_per_head, d = (e % vecs_per_head) * VEC;
    fi::vec_t<T, VEC> kv, vv;
    kv.load(key + i * key_st + h * key_sh + d);
    vv.load(value + i * val_st + h * val_sh + d);
    kv.store(k_cache + page * k_sp + off * k_st + h * k_sh + d);
    vv.store(v_cache + page * v_sp + off * v_st + h * v_sh + d);
  }
}

}  // namespace

FI_EXPORT int fi_append_paged_kv_cache(const void* key, int64_t key_st, int64_t key_sh, const void* value,
                                       int64_t val_st, int64_t val_sh, const void* batch_indices,
                                       const void* positions, void* k_cache, int64_t k_sp, int64_t k_st,
                                       int64_t k_sh, void* v_cache, int64_t v_sp, int64_t v_st,
                                       int64_t v_sh, const void* indices, const void* indptr,
                                       int64_t nnz, int64_t page_size, int64_t H, int64_t D,
                                       cudaStream_t stream) {
  if (nnz == 0) return 0;
  append_kernel<<<unsigned(nnz), 128, 0, stream>>>(
      (const T*)key, key_st, key_sh, (const T*)value, val_st, val_sh, (const int*)batch_indices,
      (const int*)positions, (T*)k_cache, k_sp, k_st, k_sh, (T*)v_cache, v_sp, v_st, v_sh,
      (const int*)indices, (const int*)indptr, int(page_size), int(H), int(D));
  return FI_LAUNCH_STATUS();
}
