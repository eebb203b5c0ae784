"""BatchDecodeWithPagedKVCacheWrapper: plan once per batch shape, run once per layer."""

from __future__ import annotations

import ctypes
import weakref
from typing import Optional

import numpy as np
import torch

from fi_core import arch_of, device_info, knobs, load
from fi_core.dtypes import parse as parse_dtype
from fi_core.errors import InputError, InputTypeError
from fi_core.launch import current_stream, is_capturing

try:  # the raw cudaStream_t of torch's current stream, without building a Stream object
    _raw_stream = torch._C._cuda_getCurrentRawStream  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - CPU-only torch builds
    _raw_stream = current_stream

from ..kv import check_kv_layout, unpack_paged_kv_cache
from ..reference import batch_decode_reference
from . import common
from .launch import DecodeArgs, page_shift
from .planner import kv_lengths, max_items, plan_decode
from .spec import heads_per_cta, select_spec

_compiling = torch.compiler.is_compiling
_check_inputs = knobs.check_inputs  # cached by knobs: ~0.25 us per run()


# is_capturing() without the torch.cuda.is_available() probe on CUDA builds (dynamo knows both).
_capturing = torch.cuda.is_current_stream_capturing if torch.version.cuda else is_capturing

_OCCUPANCY: dict = {}
# plan() signature -> backend name, and -> (kernel name, module, launch fn, CTAs per SM, SMs)
_IMPL_CACHE: dict = {}
_MODULE_CACHE: dict = {}


def _ctas_per_sm(mod) -> int:
    n = _OCCUPANCY.get(id(mod))
    if n is None:
        import ctypes  # noqa: PLC0415

        c = ctypes.c_int(0)
        mod.fi_batch_decode_occupancy(ctypes.addressof(c))
        n = _OCCUPANCY[id(mod)] = max(1, c.value)
    return n


def _host_i32(name: str, t: torch.Tensor) -> np.ndarray:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise InputTypeError(f"{name} must be int32, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != 1:
        raise InputError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t.cpu().numpy()  # a no-op view for CPU tensors; device tensors need a copy


class BatchDecodeWithPagedKVCacheWrapper:
    """Decode attention (one query token per request) over a paged KV cache.

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        uint8 scratch for split-KV partial results (128 MiB recommended).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    use_cuda_graph : bool
        Freeze the batch size and keep every device address fixed, so ``run()`` can be captured
        and replayed after a new ``plan()``. Needs the three ``paged_kv_*_buffer`` tensors.
    use_tensor_cores : bool
        Prefer the tensor-core kernel where it applies (the default already does).
    paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer : torch.Tensor
        int32 device buffers ``[batch + 1]``, ``[max_pages]``, ``[batch]`` (CUDA-graph mode).
    backend : str
        ``"auto"`` (also ``"fa2"``, ``"cuda"``): the fastest kernel for the case;
        ``"tensor-core"`` / ``"cuda-core"`` force a kernel; ``"reference"``: pure torch.

    Examples
    --------
    >>> ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")       # doctest: +SKIP
    >>> w = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")                     # doctest: +SKIP
    >>> w.plan(indptr, indices, last_page_len, 32, 8, 128, 16,
    ...        q_data_type=torch.bfloat16)                                    # doctest: +SKIP
    >>> o = w.run(q, kv_cache)  # q [B, 32, 128] -> o [B, 32, 128]            # doctest: +SKIP

    See Also
    --------
    single_decode_with_kv_cache, fi_attention.merge_states
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: Optional[torch.Tensor] = None,
                 paged_kv_indices_buffer: Optional[torch.Tensor] = None,
                 paged_kv_last_page_len_buffer: Optional[torch.Tensor] = None,
                 backend: str = "auto", jit_args=None):
        check_kv_layout(kv_layout)
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise InputTypeError("float_workspace_buffer must be a torch.Tensor, got "
                                 f"{type(float_workspace_buffer).__name__}")
        if backend not in ("auto", "fa2", "cuda", "cuda-core", "tensor-core", "reference"):
            raise InputError("backend must be 'auto', 'fa2', 'cuda', 'cuda-core', 'tensor-core' or "
                             f"'reference', got {backend!r}")
        self._kv_layout = kv_layout
        self._float_ws = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._use_cuda_graph = use_cuda_graph
        self._use_tensor_cores = use_tensor_cores
        # "auto"/"fa2"/"cuda": the fastest kernel for the case; "cuda-core"/"tensor-core" force one
        self._kernel = backend if backend in ("cuda-core", "tensor-core") else \
            ("tensor-core" if use_tensor_cores else "auto")
        self._backend = "reference" if backend == "reference" else "auto"
        if use_cuda_graph:
            for name, buf in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                              ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                              ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                if not isinstance(buf, torch.Tensor) or buf.dtype != torch.int32:
                    raise InputError(f"use_cuda_graph=True needs {name} as an int32 tensor, got "
                                     f"{type(buf).__name__ if not isinstance(buf, torch.Tensor) else buf.dtype}")
            self._fixed_batch = paged_kv_indptr_buffer.numel() - 1
        self._indptr_buf = paged_kv_indptr_buffer
        self._indices_buf = paged_kv_indices_buffer
        self._last_buf = paged_kv_last_page_len_buffer
        self._int_ws: Optional[torch.Tensor] = None
        self._capacity: Optional[int] = None
        self._planned = False
        self._kv_seen: dict = {}
        _WRAPPERS[id(self)] = self
        self._dev_index = self._device.index if self._device.index is not None else (
            torch.cuda.current_device() if self._device.type == "cuda" else -1)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None):
        self._float_ws = float_workspace_buffer

    # ---- plan ---------------------------------------------------------------------------
    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: Optional[float] = None, q_data_type="float16", kv_data_type=None,
             data_type=None, sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, non_blocking: bool = True,
             fixed_split_size: Optional[int] = None, disable_split_kv: bool = False) -> None:
        """Schedule a batch: host-side planning, one small host-to-device copy, no sync.

        ``indptr [B+1]``, ``indices [nnz_pages]``, ``last_page_len [B]`` are int32 (CPU tensors
        avoid a device read). ``fixed_split_size`` is a chunk length in pages.
        """
        group = common.heads(num_qo_heads, num_kv_heads)
        common.pos_mode(pos_encoding_mode)
        if page_size <= 0:
            raise InputError(f"page_size must be > 0, got {page_size}")
        if data_type is not None:
            q_data_type = data_type
        q_dtype = parse_dtype(q_data_type)
        kv_dtype = parse_dtype(kv_data_type) if kv_data_type is not None else q_dtype
        h_indptr = _host_i32("indptr", indptr)
        h_last = _host_i32("last_page_len", last_page_len)
        if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32:
            raise InputTypeError("indices must be an int32 tensor, got "
                                 f"{indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__}")
        batch = h_indptr.shape[0] - 1
        if batch < 0 or h_last.shape[0] != batch:
            raise InputError(f"indptr must have batch + 1 entries and last_page_len batch entries, "
                             f"got {h_indptr.shape[0]} and {h_last.shape[0]}")
        # A handful of numpy reductions (each ~1 us): plan() must stay in the tens of microseconds.
        pages = np.diff(h_indptr)
        if batch and (h_indptr[0] != 0 or pages.min() < 0):
            raise InputError(f"indptr must start at 0 and be non-decreasing, got {h_indptr.tolist()[:16]}")
        if batch and h_indptr[-1] > indices.numel():
            raise InputError(f"indptr[-1] = {h_indptr[-1]} exceeds the {indices.numel()} page indices")
        if batch and (h_last.min() < 1 or h_last.max() > page_size):
            # slow path: a request without pages may carry any last_page_len
            bad = (pages > 0) & ((h_last < 1) | (h_last > page_size))
            if np.any(bad):
                i = int(np.nonzero(bad)[0][0])
                raise InputError(f"last_page_len must be in [1, page_size={page_size}]; request {i} has {h_last[i]}")
        if self._use_cuda_graph and batch != self._fixed_batch:
            raise InputError(f"this CUDA-graph wrapper was built for batch {self._fixed_batch}, got {batch}")

        self._q_dtype, self._kv_dtype = q_dtype, kv_dtype
        self._hq, self._hkv, self._d, self._ps = num_qo_heads, num_kv_heads, head_dim, page_size
        self._pos = pos_encoding_mode
        self._window_left = -1 if window_left is None else int(window_left)
        self._cap = common.soft_cap(logits_soft_cap)
        self._sm_scale = common.softmax_scale(sm_scale, head_dim)
        self._rope_scale = 1.0 if rope_scale is None else float(rope_scale)
        self._rope_theta = 1e4 if rope_theta is None else float(rope_theta)
        self._batch = batch
        self._q_shape = torch.Size((batch, num_qo_heads, head_dim))
        self._kv_last = None
        self._h_indptr, self._h_last = h_indptr, h_last
        self._indices_in = indices
        self._planned = True
        if self._device.type != "cuda":
            self._impl = "reference"
            return
        key = (self._device, q_dtype, kv_dtype, head_dim, self._backend)
        impl = _IMPL_CACHE.get(key)
        if impl is None:
            impl = _IMPL_CACHE[key] = common.BATCH_DECODE.choose(
                self._device, q_dtype, requested=self._backend, head_dim=head_dim, kv_dtype=kv_dtype).name
        self._impl = impl
        if self._impl != "cuda":
            return
        self._plan_cuda(indptr, indices, last_page_len, group, fixed_split_size, disable_split_kv,
                        non_blocking, pages)

    def _plan_cuda(self, indptr, indices, last_page_len, group, fixed_split_size, disable_split_kv,
                   non_blocking, pages):
        dev = self._device
        key = (dev, self._q_dtype, self._kv_dtype, self._d, group, self._pos, self._cap > 0, self._kernel)
        mk = _MODULE_CACHE.get(key)
        if mk is None:  # spec hashing, module load and occupancy query: once per signature
            spec = select_spec(self._q_dtype, self._kv_dtype, self._d, group, self._pos, self._cap > 0,
                               arch_of(dev), self._kernel)
            mod = load(spec)
            sm = device_info(dev.index if dev.index is not None else torch.cuda.current_device()).sm_count
            mk = _MODULE_CACHE[key] = (spec.name, mod, mod.fn("fi_batch_decode").raw, _ctas_per_sm(mod), sm)
        self._kernel_name, mod, self._mod_launch, ctas, sm = mk
        self._mod = mod
        kv_units = self._hkv * (group // heads_per_cta(group))
        if self._batch and pages.min() > 0:  # every request has pages: no zero-length special case
            lens = pages.astype(np.int64) * self._ps - (self._ps - self._h_last)
        else:
            lens = kv_lengths(self._h_indptr, self._h_last, self._ps)
        if self._use_cuda_graph and self._capacity is None:
            # as many items as the planner may use, but no more than the workspace holds partials
            # for (the plan then splits less; a too-small workspace still fails below)
            fit = self._float_ws.numel() * self._float_ws.element_size() // (self._hq * (self._d + 1) * 4)
            self._capacity = max(self._batch, min(max_items(self._batch, kv_units, sm, ctas), fit))
        fixed = fixed_split_size * self._ps if fixed_split_size else None
        plan = plan_decode(lens, kv_units=kv_units, sm_count=sm, ctas_per_sm=ctas,
                           disable_split_kv=disable_split_kv, fixed_split_size=fixed,
                           capacity=self._capacity if self._use_cuda_graph else None)
        # Partial states live in the float workspace: o [slots, Hq, D] then lse [slots, Hq]. In
        # CUDA-graph mode the lse offset is sized for the capacity so that it never moves.
        cap = self._capacity if self._use_cuda_graph else plan.num_items
        slots = cap if self._use_cuda_graph else plan.num_slots
        need = slots * self._hq * (self._d + 1) * 4
        if need > self._float_ws.numel() * self._float_ws.element_size():
            raise InputError(f"float_workspace_buffer holds {self._float_ws.numel()} bytes but the "
                             f"split-KV plan needs {need}; pass a larger buffer (128 MiB is plenty)")
        # int32 metadata: work [cap, 4] | num_work (padded to 16 B) | merge_indptr [B + 1], then,
        # when the page table came from the host (non-graph mode), indptr | last_page_len |
        # indices in the same buffer: one host-to-device copy per plan instead of four.
        B = self._batch
        n_meta = cap * 4 + 4 + (B + 1)
        stage = not self._use_cuda_graph and all(
            t.device.type == "cpu" for t in (indptr, indices, last_page_len))
        nnz = int(self._h_indptr[-1]) if B else 0
        off_indptr, off_last, off_idx = n_meta, n_meta + B + 1, n_meta + 2 * B + 1
        n_int = off_idx + nnz if stage else n_meta
        if self._int_ws is None or self._int_ws.numel() < n_int:
            if self._use_cuda_graph and self._int_ws is not None:
                raise InputError("a re-plan of a CUDA-graph wrapper needs more metadata than the "
                                 "first plan allocated")
            size = max(n_int + n_int // 4, 4096)
            self._int_ws = torch.empty(size, dtype=torch.int32, device=dev)
            # A ring of pinned mirrors: plan() may be called again while an earlier upload is
            # still queued behind GPU work; it only waits if the ring has wrapped around.
            self._ring = [[torch.empty(size, dtype=torch.int32, pin_memory=True), torch.cuda.Event(), False]
                          for _ in range(4)]
            self._ring_pos = 0
        slot = self._ring[self._ring_pos]
        self._ring_pos = (self._ring_pos + 1) % len(self._ring)
        if slot[2]:
            slot[1].synchronize()
        host_t = slot[0]
        host = host_t.numpy()
        host[: plan.num_items * 4] = plan.work.reshape(-1)
        host[cap * 4] = plan.num_items
        host[cap * 4 + 4: cap * 4 + 5 + B] = plan.merge_indptr
        if stage:
            host[off_indptr: off_indptr + B + 1] = self._h_indptr
            host[off_last: off_last + B] = self._h_last
            host[off_idx: off_idx + nnz] = indices.numpy()[:nnz]
        self._int_ws[:n_int].copy_(host_t[:n_int], non_blocking=True)
        slot[1].record()
        slot[2] = True

        # Page table on the device: staged above, the user's device tensors, or the graph buffers.
        def dev_table(src, buf):
            if self._use_cuda_graph:
                if src.device != buf.device or src.data_ptr() != buf.data_ptr():
                    if src.numel() > buf.numel():
                        raise InputError(f"the CUDA-graph buffer holds {buf.numel()} entries, got {src.numel()}")
                    buf[: src.numel()].copy_(src, non_blocking=non_blocking)
                return buf
            return src if src.device == dev else src.to(dev, non_blocking=non_blocking)

        base = self._int_ws.data_ptr()
        a = DecodeArgs()
        if stage:  # addresses inside the metadata buffer; the tensor view is made only if needed
            self._d_indices = None
            self._staged_indices = (off_idx, nnz)
            a.kv_indptr, a.kv_indices = base + 4 * off_indptr, base + 4 * off_idx
            a.kv_last_page_len = base + 4 * off_last
        else:
            self._d_indices = dev_table(indices, self._indices_buf)
            a.kv_indptr = dev_table(indptr, self._indptr_buf).data_ptr()
            a.kv_indices = self._d_indices.data_ptr()
            a.kv_last_page_len = dev_table(last_page_len, self._last_buf).data_ptr()
        self._plan = plan
        a.work, a.num_work, a.merge_indptr = base, base + cap * 16, base + cap * 16 + 16
        a.part_o = self._float_ws.data_ptr()
        a.part_lse = a.part_o + slots * self._hq * self._d * 4
        a.num_qo_heads, a.num_kv_heads, a.page_size = self._hq, self._hkv, self._ps
        a.page_shift = page_shift(self._ps)
        a.grid_items = cap
        a.merge_batch = self._batch if (plan.split or self._use_cuda_graph) else 0
        a.sm_scale, a.logits_soft_cap = self._sm_scale, self._cap
        a.rope_scale, a.rope_theta = self._rope_scale, self._rope_theta
        self._args = a
        self._args_addr = ctypes.addressof(a)

    begin_forward = plan

    # ---- run ----------------------------------------------------------------------------
    def run(self, q: torch.Tensor, paged_kv_cache, *, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            return_lse: bool = False, enable_pdl: Optional[bool] = None,
            window_left: Optional[int] = None):
        """Decode ``q [B, Hq, D]`` against the planned batch -> ``o [B, Hq, D]`` (+ ``lse [B, Hq]``,
        float32, base 2). Launch only: no synchronisation, no host copies."""
        if not self._planned:
            raise InputError("run() called before plan()")
        # The fast path below costs ~2 us of Python: one signature compare per tensor, no torch
        # ops besides data_ptr()/stride(); knobs were read at plan() time.
        if not self._use_cuda_graph and _capturing():
            raise InputError("run() is being captured into a CUDA graph but this wrapper was built "
                             "with use_cuda_graph=False: its plan() buffers may move. Build it with "
                             "use_cuda_graph=True and fixed paged_kv_*_buffer tensors")
        if type(q) is not torch.Tensor or q.dtype != self._q_dtype:
            if not isinstance(q, torch.Tensor) or q.dtype != self._q_dtype:
                raise InputTypeError(f"q must be a {self._q_dtype} tensor (the planned q_data_type), "
                                     f"got {q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
        if q.shape != self._q_shape:
            raise InputError(f"q must have shape [{self._batch}, {self._hq}, {self._d}] (batch, "
                             f"num_qo_heads, head_dim as planned), got {tuple(q.shape)}")
        kv = self._kv_view(paged_kv_cache)
        sm_mul = 1.0 if q_scale is None else common.scale_value("q_scale", q_scale)
        ks = 1.0 if k_scale is None else common.scale_value("k_scale", k_scale)
        vs = 1.0 if v_scale is None else common.scale_value("v_scale", v_scale)
        wl = self._window_left if window_left is None else int(window_left)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        elif out.dtype != q.dtype or out.shape != self._q_shape or out.stride(-1) != 1:
            raise InputError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous last dim, "
                             f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
        if return_lse and lse is None:
            lse = torch.empty((self._batch, self._hq), dtype=torch.float32, device=q.device)
        if lse is not None and (lse.shape != (self._batch, self._hq) or lse.dtype != torch.float32
                                or not lse.is_contiguous()):
            raise InputError(f"lse must be a contiguous float32 [{self._batch}, {self._hq}] tensor, "
                             f"got {lse.dtype} {tuple(lse.shape)}")
        if _check_inputs():
            self._check_pages(kv[4])
        if _compiling():
            cache_a, cache_b = (paged_kv_cache, None) if isinstance(paged_kv_cache, torch.Tensor) \
                else tuple(paged_kv_cache)
            torch.ops.fi_attention.batch_decode_run(out, lse, q, cache_a, cache_b, id(self), sm_mul, ks, vs, wl)
        else:
            self._run_core(q, paged_kv_cache, kv, sm_mul, ks, vs, wl, out, lse)
        return (out, lse) if return_lse else out

    def _run_core(self, q, paged_kv_cache, kv, sm_mul, ks, vs, wl, out, lse):
        if self._impl != "cuda" or q.device.type != "cuda":
            self._run_reference(q, paged_kv_cache, sm_mul, ks, vs, wl, out, lse)
        else:
            self._launch(q, kv, sm_mul, ks, vs, wl, out, lse)

    def _kv_view(self, paged_kv_cache):
        """(k_ptr, k_strides, v_ptr, v_strides, num_pages) of a validated cache. Validation and
        view creation cost several microseconds, so the result is remembered per cache
        signature (addresses, shapes, strides, dtype): a serving loop passes the same per-layer
        caches every step. Only numbers are kept, never the tensors."""
        if type(paged_kv_cache) is torch.Tensor:
            c = paged_kv_cache
            key = (c.data_ptr(), c.shape, c.stride(), c.dtype)
        elif isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2 and \
                all(type(t) is torch.Tensor for t in paged_kv_cache):
            k, v = paged_kv_cache
            key = (k.data_ptr(), v.data_ptr(), k.shape, k.stride(), v.shape, v.stride(), k.dtype, v.dtype)
        else:
            key = None
        hit = self._kv_seen.get(key) if key is not None else None
        if hit is not None:
            return hit
        kv = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        if kv.num_kv_heads != self._hkv or kv.head_dim != self._d or kv.page_size != self._ps:
            raise InputError(f"paged_kv_cache has (page_size, num_kv_heads, head_dim) = "
                             f"({kv.page_size}, {kv.num_kv_heads}, {kv.head_dim}), planned "
                             f"({self._ps}, {self._hkv}, {self._d})")
        if kv.dtype != self._kv_dtype:
            raise InputTypeError(f"paged_kv_cache must be {self._kv_dtype} (the planned kv_data_type), got {kv.dtype}")
        hit = (kv.k_ptr(), kv.k_strides, kv.v_ptr(), kv.v_strides, kv.num_pages)
        if key is not None:
            if len(self._kv_seen) >= 256:
                self._kv_seen.clear()
            self._kv_seen[key] = hit
        return hit

    def _launch(self, q, kv, sm_mul, ks, vs, wl, out, lse):
        qs = q.stride()
        qp = q.data_ptr()
        if qs[2] != 1 or qp % 16 or qs[0] % 8 or qs[1] % 8:
            raise InputError(f"q rows must be contiguous and 16-byte aligned, got strides {qs}")
        if q.get_device() != self._dev_index:
            raise InputError(f"q is on cuda:{q.get_device()} but the workspace on cuda:{self._dev_index}")
        a = self._args
        a.q, a.q_stride_b, a.q_stride_h = qp, qs[0], qs[1]
        if kv is not self._kv_last:  # the same cache as the previous call: its fields are set
            a.k, (a.k_stride_page, a.k_stride_tok, a.k_stride_head), a.v, \
                (a.v_stride_page, a.v_stride_tok, a.v_stride_head) = kv[0], kv[1], kv[2], kv[3]
            self._kv_last = kv
        os_ = out.stride()
        a.out, a.o_stride_b, a.o_stride_h = out.data_ptr(), os_[0], os_[1]
        a.lse = 0 if lse is None else lse.data_ptr()
        a.window_left = wl
        a.sm_scale = self._sm_scale * sm_mul
        a.k_scale, a.v_scale = ks, vs
        rc = self._mod_launch(self._args_addr, _raw_stream(self._dev_index))
        if rc:
            raise self._mod.error(rc, "fi_batch_decode")

    def _check_pages(self, num_pages: int) -> None:
        if self._impl == "cuda":
            table = self._d_indices
            if table is None:
                off, nnz = self._staged_indices
                table = self._int_ws[off: off + nnz]
        else:
            table = self._indices_in
        used = table[: int(self._h_indptr[-1])] if self._batch else table[:0]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            raise InputError(f"page indices must be in [0, {num_pages}) (the cache's page count), "
                             f"got min {int(used.min())} max {int(used.max())}")

    def _run_reference(self, q, paged_kv_cache, sm_mul, ks, vs, wl, out, lse):
        o, s = batch_decode_reference(
            q, paged_kv_cache, torch.from_numpy(self._h_indptr), self._indices_in.cpu(),
            torch.from_numpy(self._h_last), self._kv_layout, return_lse=True,
            sm_scale=self._sm_scale * sm_mul, logits_soft_cap=self._cap or None, window_left=wl,
            pos_encoding_mode=self._pos, rope_scale=self._rope_scale, rope_theta=self._rope_theta,
            k_scale=ks, v_scale=vs)
        out.copy_(o)
        if lse is not None:
            lse.copy_(s)

    def forward(self, q, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale=None,
                k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None,
                rope_scale=None, rope_theta=None):
        """Legacy alias of run(); the attention options come from begin_forward/plan."""
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q, paged_kv_cache, **kw):
        return self.run(q, paged_kv_cache, q_scale=kw.get("q_scale"), k_scale=kw.get("k_scale"),
                        v_scale=kw.get("v_scale"), return_lse=True)

    def end_forward(self) -> None:
        """Legacy no-op."""


# Live wrappers by id: the traced custom op receives its wrapper as an int handle.
_WRAPPERS: "weakref.WeakValueDictionary[int, BatchDecodeWithPagedKVCacheWrapper]" = weakref.WeakValueDictionary()


@torch.library.custom_op("fi_attention::batch_decode_run", mutates_args=("out", "lse"))
def _batch_decode_run_op(out: torch.Tensor, lse: Optional[torch.Tensor], q: torch.Tensor,
                         cache_a: torch.Tensor, cache_b: Optional[torch.Tensor], handle: int,
                         q_scale: float, k_scale: float, v_scale: float, window_left: int) -> None:
    w = _WRAPPERS[handle]
    cache = cache_a if cache_b is None else (cache_a, cache_b)
    w._run_core(q, cache, w._kv_view(cache), q_scale, k_scale, v_scale, window_left, out, lse)


@_batch_decode_run_op.register_fake
def _(out, lse, q, cache_a, cache_b, handle, q_scale, k_scale, v_scale, window_left) -> None:
    return None


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """The CUDA-graph form of :class:`BatchDecodeWithPagedKVCacheWrapper` (FlashInfer's name):
    fixed user-owned page-table buffers, frozen batch size."""

    def __init__(self, workspace_buffer: torch.Tensor, indptr_buffer: torch.Tensor,
                 indices_buffer: torch.Tensor, last_page_len_buffer: torch.Tensor,
                 kv_layout: str = "NHD", use_tensor_cores: bool = False):
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True,
                         use_tensor_cores=use_tensor_cores, paged_kv_indptr_buffer=indptr_buffer,
                         paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)
