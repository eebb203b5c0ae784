// Host-side argument block of the batch decode launcher. Python fills a ctypes mirror of this
// struct (fi_attention.decode.launch.DecodeArgs) once per plan() and patches the per-run pointers,
// so a run() crosses the C ABI with one argument (the block's address) instead of thirty. Every
// field is 8 bytes wide, in this order, so both sides agree on the layout without padding rules.
#pragma once
#include <stdint.h>

struct DecodeArgs {
  // What a run() call sets (one contiguous pack on the Python launch path):
  int64_t q, q_stride_b, q_stride_h;                 // q [B, Hq, D]
  int64_t out, o_stride_b, o_stride_h, lse;          // lse may be 0
  double k_scale, v_scale;
  int64_t stream;                                    // cudaStream_t to launch on
  // The cache (packed when run() gets another one):
  int64_t k, k_stride_page, k_stride_tok, k_stride_head;
  int64_t v, v_stride_page, v_stride_tok, v_stride_head;
  // What plan() sets:
  int64_t kv_indptr, kv_indices, kv_last_page_len;   // int32 device arrays
  int64_t work, num_work;                            // int32 [cap, 4], int32 [1]
  int64_t merge_indptr;                              // int32 [B + 1]: partial slots per request
  int64_t part_o, part_lse;                          // float workspace
  int64_t num_qo_heads, num_kv_heads, page_size, page_shift, window_left;
  int64_t grid_items, merge_batch;                   // decode grid.x; merge grid.x (0: no merge)
  double sm_scale, logits_soft_cap, rope_scale, rope_theta;
  int64_t flags;                                     // DecodeFlag bits
  int64_t merge_count;                               // int32 [B * Hq] zeroed counters (kDecodeGridMerge)
  int64_t sched;                                     // uint64 [3 + 1024]: a CUDA-graph wrapper's spread-mode
                                                     // queue (decode_work), zeroed; 0 without
  int64_t device;                                    // CUDA device of every buffer above (< 0: the current one)
};

// DecodeArgs::flags. The decode grid is launched with programmatic dependent launch (PDL) on
// sm_90+ when kDecodePdl is set: its CTAs may start while the previous kernel in the stream still
// runs, read what plan() wrote (work items, and the page tables the two "early" bits name), and
// wait (griddepcontrol.wait) before they touch q, K/V, out or the partial states. A table may be
// read early only when plan() itself wrote it (a copy queued in plan(): no kernel that may still
// be running can be writing it); the user's own device tables are read after the wait.
enum DecodeFlag : int64_t {
  kDecodeTablesEarly = 1,   // kv_indptr and kv_last_page_len were written by plan()
  kDecodeIndicesEarly = 2,  // kv_indices too
  kDecodePdl = 4,           // launch the decode grid with PDL (run(enable_pdl=False) clears it)
  kDecodeGridMerge = 8,     // split requests merged by their last item (merge_in_grid): no merge kernel
  kDecodeRefuseCapture = 16,  // a wrapper built without use_cuda_graph: launching into a stream that is
                              // being captured returns cudaErrorStreamCaptureUnsupported, nothing queued
};
