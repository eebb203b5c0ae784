"""BatchDecodeWithPagedKVCacheWrapper: plan once per batch shape, run once per layer.

Host time is part of a decode step's latency (a step launches one or two small kernels per layer),
so both entry points are built around it:

- ``plan()`` validates its scalar options once per distinct option tuple, recognises uniform
  batches without numpy reductions, stages all int32 metadata in one pinned buffer and issues one
  host-to-device copy, and prepares the launcher's argument block.
- ``run()`` first tries a launch-only path that compares a handful of tensor attributes with the
  plan and the remembered cache signatures, writes the per-call fields of the prebuilt argument
  block and calls the launcher. Anything it does not accept (first sight of a cache, lse, a scale
  tensor, FI_CHECK_INPUTS, torch.compile tracing, a wrong input) goes through the checked path,
  which raises the errors.
"""

from __future__ import annotations

import ctypes
import warnings
import weakref
from typing import Optional

import torch

from fi_core import arch_of, checks, device_info, knobs, load, on_device
from fi_core.errors import InputError, InputTypeError

from ..kv import check_kv_layout, unpack_paged_kv_cache
from ..reference import batch_decode_reference
from .. import options
from . import common
from .launch import (CAPTURE_REFUSED, GRID_MERGE, INDICES_EARLY, OFF_KV, OFF_OPTS, OFF_RUN, OFF_SHAPE, OFF_TABLES,
                     OFF_TAIL, PACK_KV, PACK_OPTS, PACK_RUN, PACK_SHAPE, PACK_TABLES, PACK_TAIL, PDL, REFUSE_CAPTURE,
                     TABLES_EARLY, DecodeArgs, capturing, page_shift, raw_stream)
from .planner import NativePlanner, max_items, plan_uniform
from . import spec as _spec
from .spec import heads_per_cta, select_spec
from .staging import MetadataStaging
from .tables import host_tables, request_lengths

_compiling = torch.compiler.is_compiling
# The launch path's gate: True while dynamo traces (like is_compiling) at a third of its cost. Other
# tracers (make_fx, export's non-strict mode) hand run() tensor subclasses, which that path declines
# (type(q) is torch.Tensor); the checked path then asks _compiling.
_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", _compiling)
_check_inputs = knobs.check_inputs  # cached by knobs: ~0.1 us per call
# The knobs' generation (bumped by knobs.override / refresh): run()'s launch path compares it with
# the generation at which this wrapper last saw FI_CHECK_INPUTS off instead of reading the knob.
_KNOB_GEN = knobs.GENERATION
_NO_KEY = object()  # equal to no cache key
_Tensor = torch.Tensor
_INT32 = torch.int32
_CONTIGUOUS = torch.contiguous_format
# The checked path's capture test (skipped while torch.compile traces, see _run_checked). The
# launch path leaves it to the launcher (DecodeFlag kDecodeRefuseCapture).
_capturing = torch.cuda.is_current_stream_capturing if torch.version.cuda else capturing
_CAPTURE_MSG = ("run() is being captured into a CUDA graph but this wrapper was built with "
                "use_cuda_graph=False: its plan() buffers may move. Build it with use_cuda_graph=True "
                "and fixed paged_kv_*_buffer tensors")

_OCCUPANCY: dict = {}
# CUDA-graph wrappers run plans of at most one CTA per SM in spread mode (decode_work in
# decode_common.cuh); False plans them the blockIdx way (A/B timing only).
GRAPH_SPREAD = True
# plan() signature -> backend name, and -> (kernel name, module, launch fn, CTAs per SM, SMs)
_IMPL_CACHE: dict = {}
_MODULE_CACHE: dict = {}
# Scalar plan() options are remembered per wrapper only when every one is an immutable value.
_PLAIN = (type(None), bool, int, float, str, torch.dtype)


def _spread_word(o, plan) -> int:
    """The word after num_work of a CUDA-graph plan: 1 runs it in spread mode (decode_work in
    decode_common.cuh: a plan of at most one CTA per SM runs on the first CTA of each SM, wherever
    the block scheduler puts the capacity grid's CTAs)."""
    return 1 if GRAPH_SPREAD and not plan.pieces and 0 < plan.num_items * o.kv_units <= o.kernel[4] else 0


def _ctas_per_sm(mod) -> int:
    n = _OCCUPANCY.get(id(mod))
    if n is None:
        c = ctypes.c_int(0)
        mod.fi_batch_decode_occupancy(ctypes.addressof(c))
        n = _OCCUPANCY[id(mod)] = max(1, c.value)
    return n


def _cache_key(c) -> Optional[tuple]:
    """What identifies a paged cache to the kernel: addresses, shapes, strides and dtypes (None
    for anything but a tensor or a pair of tensors, which is then validated on every call)."""
    if type(c) is torch.Tensor:
        return (c.data_ptr(), c.shape, c.stride(), c.dtype)
    if isinstance(c, (tuple, list)) and len(c) == 2 and type(c[0]) is torch.Tensor and type(c[1]) is torch.Tensor:
        k, v = c
        return (k.data_ptr(), v.data_ptr(), k.shape, k.stride(), v.shape, v.stride(), k.dtype, v.dtype)
    return None


def _batch_of(indptr) -> int:
    """Requests of a plan() call's indptr before it is checked (0 when it has no length: the
    checks then say what is wrong)."""
    try:
        return len(indptr) - 1
    except TypeError:
        return 0


class _Options:
    """plan()'s scalar options, validated, with what follows from them (kernel included).

    Built in plan()'s order: the head, position-encoding, page-size and dtype checks run before
    the page table is checked, the remaining options (:meth:`finish`) after it.
    """

    __slots__ = ("group", "q_dtype", "kv_dtype", "hq", "hkv", "d", "ps", "pos", "window_left", "cap",
                 "sm_scale", "rope_scale", "rope_theta", "impl", "kernel", "kv_units", "finished",
                 "shape_fields", "opt_fields", "planner", "small_mha")

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
                 logits_soft_cap, q_data_type, kv_data_type, sm_scale, rope_scale, rope_theta, small_mha=False):
        num_qo_heads = checks.int_value("num_qo_heads", num_qo_heads, 1)
        num_kv_heads = checks.int_value("num_kv_heads", num_kv_heads, 1)
        head_dim = checks.int_value("head_dim", head_dim, 1)
        page_size = checks.int_value("page_size", page_size, 1)
        self.group = common.heads(num_qo_heads, num_kv_heads)
        self.pos = common.pos_mode(pos_encoding_mode)
        self.q_dtype = checks.dtype_value("q_data_type", q_data_type, common.Q_DTYPES)
        self.kv_dtype = self.q_dtype if kv_data_type is None else \
            checks.dtype_value("kv_data_type", kv_data_type, common.KV_DTYPES)
        self.hq, self.hkv, self.d, self.ps = num_qo_heads, num_kv_heads, head_dim, page_size
        self.kv_units = num_kv_heads * (self.group // heads_per_cta(self.group))
        self.small_mha = bool(small_mha)  # spec.small_mha_grid: select_spec may pick the ring
        self.shape_fields = (num_qo_heads, num_kv_heads, page_size, page_shift(page_size))
        self.impl = None  # resolved by the first plan() that gets past the page-table checks
        self.kernel = None
        self.planner = None  # the kernel module's native planner, for non-uniform batches
        self.finished = False

    def finish(self, num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
               logits_soft_cap, q_data_type, kv_data_type, sm_scale, rope_scale, rope_theta, small_mha=False) -> None:
        self.window_left = -1 if window_left is None else checks.int_value("window_left", window_left, -1)
        self.cap = common.soft_cap(logits_soft_cap)
        self.sm_scale = common.softmax_scale(sm_scale, head_dim)
        self.rope_scale, self.rope_theta = common.rope_options(rope_scale, rope_theta)
        self.opt_fields = (self.cap, self.rope_scale, self.rope_theta)
        self.finished = True


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
        if backend not in ("auto", "fa2", "cuda", "cuda-core", "tensor-core", "reference"):
            raise InputError("backend must be 'auto', 'fa2', 'cuda', 'cuda-core', 'tensor-core' or "
                             f"'reference', got {backend!r}")
        self._kv_layout = kv_layout
        self.reset_workspace_buffer(float_workspace_buffer)
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
        self._staging: Optional[MetadataStaging] = None
        self._graph_plain: Optional[bool] = None  # see _graph_bufs_plain
        # The launcher's argument block: plan() writes its fields, run() the per-call ones. The
        # launcher reads it during the call (a CUDA graph captures the kernel parameters).
        self._args = DecodeArgs()
        self._args_addr = ctypes.addressof(self._args)
        self._flags = PDL  # DecodeArgs.flags of the current plan (_finish_cuda_plan)
        self._counters: Optional[torch.Tensor] = None  # see _merge_counters
        self._sched: Optional[torch.Tensor] = None  # see _spread_queue
        self._sched_grid = 0
        self._spread = 0  # the last CUDA-graph plan's spread-mode word (_spread_word)
        self._graph_sig = None  # a CUDA-graph plan's kernel and options (_warn_if_graph_options_change)
        self._retired_counters: list = []
        self._capacity: Optional[int] = None
        self._planned = False
        self._options: dict = {}  # plan() scalar options -> _Options
        # The launch path's state, set by a plan() of the CUDA kernel (see _finish_cuda_plan); it is
        # taken while _fast_gen is the knobs' generation (-1: never).
        self._fast: Optional[tuple] = None
        self._fast_gen = -1
        self._kv_packed: tuple = (_NO_KEY, None)  # (cache key, _kv_view numbers) in the argument block
        # Validated caches of the current plan's geometry: signature -> numbers (see _kv_view).
        self._kv_seen: dict = {}
        self._kv_geometry = None
        _WRAPPERS[id(self)] = self
        self._dev_index = self._device.index if self._device.index is not None else (
            torch.cuda.current_device() if self._device.type == "cuda" else -1)
        # the launcher makes this GPU current for its launch when it is not (DecodeArgs.device)
        self._args.device = self._dev_index

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None):
        self._ws_bytes = checks.workspace(float_workspace_buffer, getattr(self, "_device", None))
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
        self._planned = False  # until this plan is complete: a failed one leaves no stale plan
        self._fast = None
        self._fast_gen = -1
        if data_type is not None:
            q_data_type = data_type
        if fixed_split_size is not None:
            fixed_split_size = checks.int_value("fixed_split_size", fixed_split_size, 0)
        # A small MHA batch may take another kernel (spec.MHA_RING_MAX_UNITS): its own _Options,
        # module and planner. The last field only splits the key; _Options ignores it.
        key = (num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
               logits_soft_cap, q_data_type, kv_data_type, sm_scale, rope_scale, rope_theta,
               _spec.small_mha_grid(num_qo_heads, num_kv_heads, _batch_of(indptr)))
        try:
            o = self._options.get(key)
        except TypeError:  # an unhashable option: validated below, never remembered
            o = None
        if o is None:
            o = _Options(*key)
            if all(type(x) in _PLAIN for x in key):  # a tensor option could change under us
                if len(self._options) >= 64:
                    self._options.clear()
                self._options[key] = o
        planner = o.planner
        if (planner is not None and planner.staged is not None
                and type(indptr) is _Tensor and type(last_page_len) is _Tensor and type(indices) is _Tensor
                and indptr.dtype is _INT32 and last_page_len.dtype is _INT32 and indices.dtype is _INT32
                and indptr.is_cpu and last_page_len.is_cpu and indptr.dim() == 1 and last_page_len.dim() == 1
                and indptr.shape[0] == last_page_len.shape[0] + 1 > 1 and indptr.is_contiguous()
                and last_page_len.is_contiguous() and indices.dim() == 1
                and (indices.is_contiguous() if indices.is_cpu else indices.device == self._device)
                and self._plan_staged(o, indptr, indices, last_page_len, fixed_split_size, disable_split_kv)):
            return
        h_indptr, h_last = host_tables(indptr, last_page_len)
        checks.int32_vector("indices", indices)
        lens = request_lengths(h_indptr, h_last, o.ps, indices.numel(), lengths=False)  # None: not uniform
        batch = h_last.shape[0]
        if self._use_cuda_graph and batch != self._fixed_batch:
            raise InputError(f"this CUDA-graph wrapper was built for batch {self._fixed_batch}, got {batch}")
        if not o.finished:
            o.finish(*key)

        self._set_plan_state(o, batch, indices)
        self._h_indptr, self._h_last = h_indptr, h_last
        if o.impl is None:
            if self._device.type != "cuda":
                o.impl = "reference"
            else:
                ikey = (self._device, o.q_dtype, o.kv_dtype, o.d, self._backend)
                impl = _IMPL_CACHE.get(ikey)
                if impl is None:
                    impl = _IMPL_CACHE[ikey] = common.BATCH_DECODE.choose(
                        self._device, o.q_dtype, requested=self._backend, head_dim=o.d,
                        kv_dtype=o.kv_dtype).name
                o.impl = impl
        self._impl = o.impl
        if o.impl == "cuda":
            if o.kernel is None:
                o.kernel = self._decode_module(o)
            self._plan_cuda(o, indptr, indices, last_page_len, lens, fixed_split_size, disable_split_kv,
                            non_blocking)
        self._planned = True

    def _set_plan_state(self, o: _Options, batch: int, indices: torch.Tensor) -> None:
        """The plan's options and batch as run() reads them; not yet planned."""
        self._q_dtype, self._kv_dtype = o.q_dtype, o.kv_dtype
        self._hq, self._hkv, self._d, self._ps = o.hq, o.hkv, o.d, o.ps
        self._pos, self._window_left, self._cap, self._sm_scale = o.pos, o.window_left, o.cap, o.sm_scale
        self._rope_scale, self._rope_theta = o.rope_scale, o.rope_theta
        self._batch = batch
        self._q_shape = torch.Size((batch, o.hq, o.d))
        self._indices_in = indices
        geometry = (o.hkv, o.d, o.ps, o.kv_dtype)
        if geometry != self._kv_geometry:  # caches validated for another geometry must be re-checked
            self._kv_seen = {}
            self._kv_geometry = geometry

    def _host_tables(self) -> tuple:
        """(indptr, last_page_len) of the plan as numpy arrays (the staged plan keeps the tensors
        and makes the views only when a checked run() needs them)."""
        if self._h_indptr is None:
            self._h_indptr, self._h_last = host_tables(*self._h_src)
        return self._h_indptr, self._h_last

    def _plan_staged(self, o: _Options, indptr, indices, last_page_len, fixed_split_size,
                     disable_split_kv) -> bool:
        """plan() of host indptr / last_page_len tables with page ids on the host or this device,
        once a plan with these options has loaded the module: one native call checks the table,
        plans it and writes plan and table into the pinned staging mirror. In CUDA-graph mode the
        tables then go from the metadata buffer into the wrapper's fixed buffers in one device-to-
        device call. False (nothing changed) when the table fails a check or the case is one the
        Python path handles (it then raises the error or does the work)."""
        batch = last_page_len.shape[0]
        host_idx = indices.is_cpu
        graph = self._use_cuda_graph
        st = self._staging
        if graph:
            xb = self._indices_buf
            if batch != self._fixed_batch or st is None or not self._graph_bufs_plain() or xb.numel() < indices.numel():
                return False
            capacity = self._capacity
        else:
            capacity = None
            if st is None:
                st = self._staging = MetadataStaging(self._device, 4096)
        fixed = fixed_split_size * o.ps if fixed_split_size else None
        while True:
            host, addr = st.host_and_address()
            plan, off_indptr, n = o.planner.plan_staged(
                indptr.data_ptr(), last_page_len.data_ptr(), batch, indices.numel(),
                indices.data_ptr() if host_idx else 0, disable_split_kv, fixed, capacity, host, addr)
            if plan is not None:
                nnz = n
                break
            if n < 0 or graph:  # a bad table; or a graph wrapper's fixed buffer is too small
                return False
            st = self._staging = MetadataStaging(self._device, n + n // 4)  # n entries needed
        self._set_plan_state(o, batch, indices)
        self._h_indptr = self._h_last = None
        self._h_src = (indptr, last_page_len)
        self._kernel_name, self._mod, launch = o.kernel[:3]
        cap, slots = (capacity, capacity) if graph else (plan.num_items, plan.num_slots)
        self._check_workspace(o, slots)
        if graph:
            host[cap * 4 + 1] = self._spread = _spread_word(o, plan)
        off_last, off_idx = off_indptr + batch + 1, off_indptr + 2 * batch + 1
        st.upload(off_idx + nnz if host_idx else off_idx)
        base = st.device_ptr
        if graph:
            ib, lb = self._indptr_buf, self._last_buf
            if host_idx:
                idx_copy = (xb.data_ptr(), base + 4 * off_idx, 4 * nnz)
            elif indices.data_ptr() != xb.data_ptr():
                idx_copy = (xb.data_ptr(), indices.data_ptr(), 4 * indices.numel())
            else:  # the page ids are already in the graph buffer
                idx_copy = (0, 0, 0)
            with on_device(self._dev_index):
                rc = self._mod.fn("fi_copy_tables").raw(ib.data_ptr(), base + 4 * off_indptr, 4 * (batch + 1),
                                                        lb.data_ptr(), base + 4 * off_last, 4 * batch, *idx_copy,
                                                        raw_stream(self._dev_index))
            if rc:
                raise self._mod.error(rc, "fi_copy_tables")
            self._d_indices = xb
            self._d_tables = (ib, xb, lb)
            tables = (ib.data_ptr(), xb.data_ptr(), lb.data_ptr())
            early = TABLES_EARLY | (INDICES_EARLY if idx_copy[0] else 0)  # copied by plan(), or the user's
        else:
            tables = self._point_at_staging(base, off_indptr, batch, nnz, None if host_idx else indices)
            early = TABLES_EARLY | (INDICES_EARLY if host_idx else 0)
        self._finish_cuda_plan(o, plan, tables, base, cap, slots, graph, launch, early)
        self._planned = True
        return True

    def _check_workspace(self, o: _Options, slots: int) -> None:
        """Partial states live in the float workspace: o [slots, Hq, D] then lse [slots, Hq]."""
        need = slots * o.hq * (o.d + 1) * 4
        if need > self._ws_bytes:
            raise InputError(f"float_workspace_buffer holds {self._ws_bytes} bytes but the "
                             f"split-KV plan needs {need}; pass a larger buffer (128 MiB is plenty)")

    def _point_at_staging(self, base: int, off_indptr: int, batch: int, nnz: int, d_indices) -> tuple:
        """Kernel table addresses (indptr, indices, last_page_len) when indptr and last_page_len
        sit behind the plan in the metadata buffer at ``base``, and the page ids too (``d_indices``
        None) or in the device tensor ``d_indices``. Holds what run() must keep alive."""
        off_last, off_idx = off_indptr + batch + 1, off_indptr + 2 * batch + 1
        if d_indices is None:  # addresses inside the metadata buffer; the tensor view only if needed
            self._d_indices = None
            self._d_tables = None
            self._staged_indices = (off_idx, nnz)
            return base + 4 * off_indptr, base + 4 * off_idx, base + 4 * off_last
        self._d_indices = d_indices
        self._d_tables = (d_indices,)
        return base + 4 * off_indptr, d_indices.data_ptr(), base + 4 * off_last

    def _graph_bufs_plain(self) -> bool:
        """The CUDA-graph table buffers are contiguous 1-D tensors on this device (what the staged
        path copies into; anything else takes the Python path's copies)."""
        ok = self._graph_plain
        if ok is None:
            ok = self._graph_plain = all(
                b.device == self._device and b.dim() == 1 and b.is_contiguous()
                for b in (self._indptr_buf, self._indices_buf, self._last_buf))
        return ok

    def _decode_module(self, o: _Options) -> tuple:
        """(kernel name, module, launcher, CTAs per SM, SMs, whether it runs piece chains (sm_90+:
        see planner.plan_pieces)): spec hashing, the module load and the occupancy query, once per
        signature."""
        dev = self._device
        # the tuning values of spec.py (bench A/B options) are part of the module's identity
        key = (dev, o.q_dtype, o.kv_dtype, o.d, o.group, o.pos, o.cap > 0, self._kernel, o.small_mha,
               _spec.MMA_VARIANT, _spec.MMA_STAGES, _spec.PAGE_AHEAD, tuple(sorted(_spec.MMA_AB.items())))
        mk = _MODULE_CACHE.get(key)
        if mk is None:
            arch = arch_of(dev)
            args = (o.q_dtype, o.kv_dtype, o.d, o.group, o.pos, o.cap > 0, arch, self._kernel, o.small_mha)
            spec = select_spec(*args)
            mod = load(spec)
            sm = device_info(dev.index if dev.index is not None else torch.cuda.current_device()).sm_count
            mk = _MODULE_CACHE[key] = (spec.name, mod, mod.fn("fi_batch_decode").raw, _ctas_per_sm(mod), sm,
                                       arch.major >= 9)
        return mk

    def _plan_cuda(self, o: _Options, indptr, indices, last_page_len, lens, fixed_split_size,
                   disable_split_kv, non_blocking):
        self._kernel_name, self._mod, launch, ctas, sm, pieces = o.kernel
        graph = self._use_cuda_graph
        B = self._batch
        if graph and self._capacity is None:
            # as many items as the planner may use, but no more than the workspace holds partials
            # for (the plan then splits less; a too-small workspace still fails below)
            fit = self._ws_bytes // (o.hq * (o.d + 1) * 4)
            self._capacity = max(B, min(max_items(B, o.kv_units, sm, ctas), fit))
        capacity = self._capacity if graph else None
        fixed = fixed_split_size * o.ps if fixed_split_size else None
        planner = o.planner
        if planner is None:  # the next plans with these options take _plan_staged where they can
            planner = o.planner = NativePlanner(self._mod.fn("fi_plan_decode").raw, o.kv_units, sm, ctas, o.ps,
                                                self._mod.fn("fi_plan_decode_staged").raw, pieces)
        if type(lens) is int:  # positional arguments: they are the plan cache's key
            plan = plan_uniform(B, lens, o.kv_units, sm, ctas, disable_split_kv, fixed, capacity)
        else:
            if (indptr.is_cpu and last_page_len.is_cpu and indptr.is_contiguous()
                    and last_page_len.is_contiguous()):  # host_tables' numpy arrays are views of these
                plan = planner.plan_at(indptr.data_ptr(), last_page_len.data_ptr(), B, disable_split_kv, fixed,
                                       capacity)
            else:
                plan = planner(self._h_indptr, self._h_last, disable_split_kv, fixed, capacity)
        # Partial states live in the float workspace: o [slots, Hq, D] then lse [slots, Hq]. In
        # CUDA-graph mode the lse offset is sized for the capacity so that it never moves.
        cap = capacity if graph else plan.num_items
        slots = cap if graph else plan.num_slots
        self._check_workspace(o, slots)
        # int32 metadata: work [cap, 4] | num_work (padded to 16 B) | merge_indptr [B + 1], then,
        # when indptr and last_page_len came from the host (non-graph mode), indptr |
        # last_page_len and, if also on the host, indices in the same buffer: one host-to-device
        # copy per plan instead of up to four (a pageable-memory copy costs ~10 us of host time).
        n_meta = cap * 4 + 4 + (B + 1)
        stage = not graph and indptr.is_cpu and last_page_len.is_cpu
        stage_idx = stage and indices.is_cpu
        nnz = self._h_indptr.item(-1) if B else 0
        off_indptr, off_last, off_idx = n_meta, n_meta + B + 1, n_meta + 2 * B + 1
        n_int = off_idx + (nnz if stage_idx else 0) if stage else n_meta
        st = self._staging
        if st is None or st.size < n_int:
            if graph and st is not None:
                raise InputError("a re-plan of a CUDA-graph wrapper needs more metadata than the "
                                 "first plan allocated")
            # a graph wrapper's buffer never moves (its address is in the captured kernels): room
            # for the tables too, which later plans stage with the metadata (_plan_staged), with
            # the page ids when they come from the host: as many as the graph's indices buffer
            # holds, so that growing requests keep the staged path (device page ids need none;
            # a later plan with host ids then copies them the Python way)
            if graph:
                size = n_meta + 2 * B + 1 + (self._indices_buf.numel() if indices.is_cpu else 0)
            else:
                size = n_int + n_int // 4
            st = self._staging = MetadataStaging(self._device, max(size, 4096))
        host = st.host()
        if graph:  # the grid keeps its capacity: idle items read num_work and exit
            n4 = plan.num_items * 4
            host[:n4] = plan.packed[:n4]
            host[cap * 4: n_meta] = plan.packed[n4:]
            host[cap * 4 + 1] = self._spread = _spread_word(o, plan)
        else:
            host[:n_meta] = plan.packed
        if stage:
            host[off_indptr: off_last] = self._h_indptr
            host[off_last: off_idx] = self._h_last
            if stage_idx:
                idx = indices.numpy()
                host[off_idx: off_idx + nnz] = idx if idx.shape == (nnz,) else idx[:nnz]
        st.upload(n_int)

        # Page table on the device: staged above, the user's device tensors, or the graph buffers.
        base = st.device_ptr
        # Tables plan() writes itself (staged, uploaded or copied into a graph buffer) may be read
        # by the kernel before it waits for the previous grid (DecodeFlag); the user's are not.
        ours = self._plan_writes
        if stage:  # page ids staged too, or on the device (the usual serving layout)
            tables = self._point_at_staging(base, off_indptr, B, nnz, None if stage_idx else
                                            self._dev_table(indices, self._indices_buf, graph, non_blocking))
            early = TABLES_EARLY | (INDICES_EARLY if stage_idx or ours(indices, self._indices_buf, graph) else 0)
        else:
            early = TABLES_EARLY if (ours(indptr, self._indptr_buf, graph)
                                     and ours(last_page_len, self._last_buf, graph)) else 0
            early |= INDICES_EARLY if ours(indices, self._indices_buf, graph) else 0
            self._d_indices = self._dev_table(indices, self._indices_buf, graph, non_blocking)
            # Held until the next plan: the kernels read these at run(). A table copied here from
            # the host (e.g. host indptr next to device indices in graph mode, or a host indices
            # next to device indptr) is a new tensor; freed, its block could be handed to another
            # tensor and overwritten before run() launches.
            self._d_tables = (self._dev_table(indptr, self._indptr_buf, graph, non_blocking), self._d_indices,
                              self._dev_table(last_page_len, self._last_buf, graph, non_blocking))
            tables = tuple(t.data_ptr() for t in self._d_tables)
        self._finish_cuda_plan(o, plan, tables, base, cap, slots, graph, launch, early)

    def _plan_writes(self, src: torch.Tensor, buf: Optional[torch.Tensor], graph: bool) -> bool:
        """Whether the device table the kernel reads for ``src`` is one this plan() writes (see
        _dev_table): an upload of a host or other-device tensor, or a copy into the CUDA-graph
        buffer ``buf``; not the user's tensor itself."""
        if graph:
            return src.device != buf.device or src.data_ptr() != buf.data_ptr()
        return src.device != self._device

    def _finish_cuda_plan(self, o: _Options, plan, tables: tuple, base: int, cap: int, slots: int, graph: bool,
                          launch, early: int) -> None:
        """The launch arguments of a CUDA plan: page tables (indptr, indices, last_page_len
        addresses), the metadata at ``base`` (work [cap, 4] | num_work | merge_indptr), the
        partial states of ``slots`` in the workspace, the DecodeFlag bits (``early``: the tables
        plan() wrote; the grid launches with PDL unless a run() says enable_pdl=False) and the
        run() fast path."""
        self._plan = plan
        if graph:
            self._warn_if_graph_options_change(o)
        a = self._args
        a.flags = self._flags = early | PDL | GRID_MERGE | (0 if graph else REFUSE_CAPTURE)
        a.merge_count = self._merge_counters(self._batch * o.hq, graph) if (plan.split or graph) else 0
        a.sched = self._spread_queue(cap * o.kv_units) if graph else 0
        PACK_TABLES(a, OFF_TABLES, *tables, base, base + cap * 16, base + cap * 16 + 16)
        part_o = self._float_ws.data_ptr()
        PACK_SHAPE(a, OFF_SHAPE, part_o, part_o + slots * o.hq * o.d * 4, *o.shape_fields)
        PACK_OPTS(a, OFF_OPTS, *o.opt_fields)
        # window_left, grid_items, merge_batch, sm_scale (a run() that overrides window_left or q_scale
        # writes its own for its launch)
        self._tail = (o.window_left, cap, self._batch if (plan.split or graph) else 0, o.sm_scale)
        PACK_TAIL(a, OFF_TAIL, *self._tail)
        self._mod_launch = launch
        self._kv_packed = (_NO_KEY, None)
        # q and out strides when they are contiguous (is_contiguous() ignores dimensions of size 1,
        # whose strides address nothing; these are the strides torch.empty_like gives)
        dense = (o.hq * o.d, o.d, 1)
        self._fast = (o.q_dtype, self._q_shape, self._dev_index, self._kv_seen, a, self._args_addr, launch, dense)
        try:
            self._fast_gen = -1 if _check_inputs() else _KNOB_GEN[0]
        except ValueError:  # a bad FI_CHECK_INPUTS value: the checked path of run() reports it
            self._fast_gen = -1

    def _warn_if_graph_options_change(self, o: _Options) -> None:
        """A captured graph replays the kernel and the scalar arguments of its capture: a re-plan
        of a CUDA-graph wrapper updates the device metadata those kernels read, but not a kernel
        or option that changed. Such a re-plan warns once per change (the graphs must be captured
        again)."""
        sig = (self._kernel_name, o.window_left, o.cap, o.sm_scale, o.rope_scale, o.rope_theta)
        prev = self._graph_sig
        self._graph_sig = sig
        if prev is not None and prev != sig:
            names = ("kernel", "window_left", "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta")
            diff = ", ".join(f"{n} {a!r} -> {b!r}" for n, a, b in zip(names, prev, sig) if a != b)
            warnings.warn(f"CUDA-graph wrapper re-planned with other options ({diff}): graphs captured "
                          "before this plan() keep the kernel and options of their capture; capture them "
                          "again", stacklevel=5)

    def _merge_counters(self, n: int, graph: bool) -> int:
        """Address of at least ``n`` zeroed int32 arrival counters, one per (request, query head),
        for the merge of split requests inside the decode grid (merge_in_grid, decode_common.cuh).
        Zeroed once when allocated: the item that merges puts its counter back to 0. A grown-out
        buffer of a CUDA-graph wrapper stays alive (kernels captured before hold its address)."""
        c = self._counters
        if c is None or c.numel() < n:
            if graph and c is not None:
                self._retired_counters.append(c)
            c = self._counters = torch.zeros(max(n, 1024), dtype=torch.int32, device=self._device)
        return c.data_ptr()

    def _spread_queue(self, grid: int) -> int:
        """Address of a CUDA-graph wrapper's spread-mode queue (decode_work, decode_common.cuh):
        uint64 [3 + 1024], zeroed when allocated and whenever the grid size changes (its launch
        numbers are tickets / grid). Allocated once: captured kernels hold its address."""
        q = self._sched
        if q is None:
            q = self._sched = torch.zeros(3 + 1024, dtype=torch.int64, device=self._device)
        elif grid != self._sched_grid:
            q.zero_()
        self._sched_grid = grid
        return q.data_ptr()

    def _dev_table(self, src, buf, graph, non_blocking):
        """A page table on the device: the user's device tensor, an upload of a host one, or (CUDA-
        graph mode) the fixed buffer, ``src`` copied into it unless it is that buffer."""
        if graph:
            if src.device != buf.device or src.data_ptr() != buf.data_ptr():
                n = src.numel()
                size = buf.numel()
                if n > size:
                    raise InputError(f"the CUDA-graph buffer holds {size} entries, got {n}")
                # buf[:n] is buf itself for a 1-D buffer of n entries: no view to build (~1 us)
                (buf if n == size and buf.dim() == 1 else buf[:n]).copy_(src, non_blocking=non_blocking)
            return buf
        return src if src.device == self._device else src.to(self._device, non_blocking=non_blocking)

    begin_forward = plan

    # ---- run ----------------------------------------------------------------------------
    def run(self, q: torch.Tensor, paged_kv_cache, *, q_scale: Optional[float] = None,
            k_scale: Optional[float] = None, v_scale: Optional[float] = None,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            return_lse: bool = False, enable_pdl: Optional[bool] = None,
            window_left: Optional[int] = None):
        """Decode ``q [B, Hq, D]`` against the planned batch -> ``o [B, Hq, D]`` (+ ``lse [B, Hq]``,
        float32, base 2). Launch only: no synchronisation, no host copies.

        ``enable_pdl`` (None: on where the GPU has it, sm_90+): the decode grid launches with
        programmatic dependent launch, so its CTAs start and read the plan while the previous
        kernel finishes; q, K/V and the outputs are touched only after it completed. False
        launches after the previous kernel as usual (e.g. when a kernel before run() writes the
        page tables plan() was given on the device and signals its dependents early)."""
        # The launch path accepts a call only when each check the checked path would make passes,
        # and then never raises an input error itself: declined calls take the checked path.
        # torch.compile traces only the first test (then the checked path and its custom op). The
        # capture test of a wrapper built without use_cuda_graph is the launcher's (REFUSE_CAPTURE).
        if (not _dynamo_compiling() and self._fast_gen == _KNOB_GEN[0] and lse is None and not return_lse
                and q_scale is None and window_left is None and (enable_pdl is None or enable_pdl is True)):
            q_dtype, q_shape, dev, seen, a, addr, launch, dense = self._fast
            if (type(q) is _Tensor and q.dtype is q_dtype and q.shape == q_shape and q.get_device() == dev
                    and (k_scale is None or (type(k_scale) is float and k_scale - k_scale == 0.0))  # finite
                    and (v_scale is None or (type(v_scale) is float and v_scale - v_scale == 0.0))
                    and (out is None or (type(out) is _Tensor and out.dtype is q_dtype and out.shape == q_shape
                                         and out.get_device() == dev))):
                c = paged_kv_cache
                key = (c.data_ptr(), c.shape, c.stride(), c.dtype) if type(c) is _Tensor else _cache_key(c)
                packed = self._kv_packed  # the previous call's cache: its fields are set
                kv = packed[1] if key == packed[0] else seen.get(key)
                qp = q.data_ptr()
                # dense strides pass the stride tests: every CUDA head_dim (spec.HEAD_DIMS) is a
                # multiple of 8 (test_dense_q_strides_pass_the_launch_path_tests)
                if q.is_contiguous():
                    qs, ok = dense, not qp % 16
                else:
                    qs = q.stride()
                    ok = qs[2] == 1 and not (qp % 16 or qs[0] % 8 or qs[1] % 8)
                if kv is not None and ok:
                    if out is None:  # contiguous: empty_like(q) keeps the layout of a contiguous q
                        out = torch.empty_like(q) if qs is dense else torch.empty_like(q, memory_format=_CONTIGUOUS)
                        os_ = dense
                    else:
                        os_ = dense if out.is_contiguous() else out.stride()
                    if os_[2] == 1:
                        if kv is not packed[1]:
                            PACK_KV(a, OFF_KV, *kv[0])
                            self._kv_packed = (key, kv)
                        PACK_RUN(a, OFF_RUN, qp, qs[0], qs[1], out.data_ptr(), os_[0], os_[1], 0,
                                 1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale,
                                 raw_stream(dev))
                        rc = launch(addr)
                        if rc:
                            raise self._launch_error(rc)
                        return out
        return self._run_checked(q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse,
                                 window_left, enable_pdl)

    def _run_checked(self, q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse, window_left,
                     enable_pdl=None):
        """run() with every input check; the only path for the reference backend, lse, scale
        tensors, enable_pdl=False, FI_CHECK_INPUTS and torch.compile (whose custom op launches as
        planned: with PDL)."""
        if not self._planned:
            raise InputError("run() called before plan()")
        if enable_pdl is not None and not isinstance(enable_pdl, bool):
            raise InputTypeError(f"enable_pdl must be None or a bool, got {type(enable_pdl).__name__}")
        # Under torch.compile the test would run once, at trace time, and dynamo cannot trace the
        # query on every torch build (the CUDA build's GPU-machine torch raised Unsupported there).
        if not self._use_cuda_graph and not _compiling() and _capturing():
            raise InputError(_CAPTURE_MSG)
        if self._fast is not None and not _check_inputs():  # FI_CHECK_INPUTS is off (again)
            self._fast_gen = _KNOB_GEN[0]
        if type(q) is not torch.Tensor or q.dtype != self._q_dtype:
            if not isinstance(q, torch.Tensor) or q.dtype != self._q_dtype:
                raise InputTypeError(f"q must be a {self._q_dtype} tensor (the planned q_data_type), "
                                     f"got {q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
        if q.shape != self._q_shape:
            raise InputError(f"q must have shape [{self._batch}, {self._hq}, {self._d}] (batch, "
                             f"num_qo_heads, head_dim as planned), got {tuple(q.shape)}")
        if self._foreign(q):
            raise InputError(f"q is on {q.device}, the wrapper's workspace on {self._device}")
        kv = self._kv_view(paged_kv_cache)
        sm_mul = 1.0 if q_scale is None else common.scale_value("q_scale", q_scale)
        ks = 1.0 if k_scale is None else common.scale_value("k_scale", k_scale)
        vs = 1.0 if v_scale is None else common.scale_value("v_scale", v_scale)
        wl = self._window_left if window_left is None else checks.int_value("window_left", window_left, -1)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        elif (checks.tensor("out", out).dtype != q.dtype or out.shape != self._q_shape or out.stride(-1) != 1
              or out.device != q.device):
            raise InputError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device} with a contiguous last "
                             f"dim, got {out.dtype} {tuple(out.shape)} on {out.device} strides {out.stride()}")
        if return_lse and lse is None:
            lse = torch.empty((self._batch, self._hq), dtype=torch.float32, device=q.device)
        if lse is not None and (checks.tensor("lse", lse).shape != (self._batch, self._hq) or lse.dtype != torch.float32
                                or not lse.is_contiguous() or lse.device != q.device):
            raise InputError(f"lse must be a contiguous float32 [{self._batch}, {self._hq}] tensor on "
                             f"{q.device}, got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
        # a CPU table's values cost no device read (the reference on CPU would index with them)
        if _check_inputs() or (self._impl != "cuda" and q.device.type == "cpu" and not _compiling()):
            self._check_pages(kv[1])
        if _compiling():
            cache_a, cache_b = (paged_kv_cache, None) if isinstance(paged_kv_cache, torch.Tensor) \
                else tuple(paged_kv_cache)
            torch.ops.fi_attention.batch_decode_run(out, lse, q, cache_a, cache_b, id(self), sm_mul, ks, vs, wl)
        else:
            self._run_core(q, paged_kv_cache, kv, sm_mul, ks, vs, wl, out, lse, enable_pdl is not False)
        return (out, lse) if return_lse else out

    def _run_core(self, q, paged_kv_cache, kv, sm_mul, ks, vs, wl, out, lse, pdl=True):
        if self._impl != "cuda" or q.device.type != "cuda":
            checks.last_dim_contiguous("q", q)  # the kernels' layout rule (_launch tests it there)
            self._run_reference(q, paged_kv_cache, sm_mul, ks, vs, wl, out, lse)
        else:
            self._launch(q, kv, sm_mul, ks, vs, wl, out, lse, pdl)

    def _foreign(self, t: torch.Tensor) -> bool:
        """t is not on the wrapper's device. By index, as the launch path compares (CPU: -1), so
        that decode.hostsim's CPU tensors pass on its simulated cuda:0; a meta tensor is never an
        input."""
        return t.get_device() != self._dev_index or t.is_meta

    def _kv_view(self, paged_kv_cache):
        """((k_ptr, k page/token/head strides, v_ptr, v strides), num_pages) of a validated cache.
        Validation and view creation cost several microseconds, so the result is remembered per
        cache signature (see _cache_key) until a plan() changes the geometry it was checked
        against: a serving loop passes the same per-layer caches every step. Only numbers are
        kept, never the tensors. While torch.compile traces, the cache is validated (shapes and
        dtypes are static in the trace) but neither remembered nor addressed: the custom op makes
        the view when it runs."""
        compiling = _compiling()
        key = None if compiling else _cache_key(paged_kv_cache)
        hit = self._kv_seen.get(key) if key is not None else None
        if hit is not None:
            return hit
        kv = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        if self._foreign(kv.k):  # a kernel given host pointers faults and takes the context with it
            raise InputError(f"paged_kv_cache is on {kv.device}, the wrapper's workspace on {self._device}")
        if kv.num_kv_heads != self._hkv or kv.head_dim != self._d or kv.page_size != self._ps:
            raise InputError(f"paged_kv_cache has (page_size, num_kv_heads, head_dim) = "
                             f"({kv.page_size}, {kv.num_kv_heads}, {kv.head_dim}), planned "
                             f"({self._ps}, {self._hkv}, {self._d})")
        if kv.dtype != self._kv_dtype:
            raise InputTypeError(f"paged_kv_cache must be {self._kv_dtype} (the planned kv_data_type), got {kv.dtype}")
        if max(*kv.k_strides[:2], *kv.v_strides[:2]) >= 1 << 31:  # the kernels' 32-bit row strides
            raise InputError(f"paged_kv_cache page/token strides must be below 2^31 elements, got K "
                             f"{kv.k_strides[:2]} and V {kv.v_strides[:2]}")
        if compiling:
            return None, kv.num_pages
        hit = ((kv.k_ptr(), *kv.k_strides, kv.v_ptr(), *kv.v_strides), kv.num_pages)
        if key is not None:
            if len(self._kv_seen) >= 256:
                self._kv_seen.clear()
            self._kv_seen[key] = hit
        return hit

    def _launch(self, q, kv, sm_mul, ks, vs, wl, out, lse, pdl=True):
        qs = q.stride()
        qp = q.data_ptr()
        if qs[2] != 1 or qp % 16 or qs[0] % 8 or qs[1] % 8:
            raise InputError(f"q rows must be contiguous and 16-byte aligned, got strides {qs}")
        if q.get_device() != self._dev_index:
            raise InputError(f"q is on cuda:{q.get_device()} but the workspace on cuda:{self._dev_index}")
        a = self._args
        if kv is not self._kv_packed[1]:  # the same cache as the previous call: its fields are set
            PACK_KV(a, OFF_KV, *kv[0])
            self._kv_packed = (_NO_KEY, kv)
        os_ = out.stride()
        PACK_RUN(a, OFF_RUN, qp, qs[0], qs[1], out.data_ptr(), os_[0], os_[1], 0 if lse is None else lse.data_ptr(),
                 ks, vs, raw_stream(self._dev_index))
        # This launch only: the fast path's argument block keeps plan()'s window, scale and flags.
        tail = self._tail
        sm_scale = self._sm_scale * sm_mul
        own_tail = wl != tail[0] or sm_scale != tail[3]
        if own_tail:
            PACK_TAIL(a, OFF_TAIL, wl, tail[1], tail[2], sm_scale)
        if not pdl:
            a.flags = self._flags & ~PDL
        try:
            rc = self._mod_launch(self._args_addr)
        finally:
            if own_tail:
                PACK_TAIL(a, OFF_TAIL, *tail)
            a.flags = self._flags
        if rc:
            raise self._launch_error(rc)

    def _launch_error(self, rc: int) -> Exception:
        """The error of a launcher's return code: CAPTURE_REFUSED (a stream being captured, for a
        wrapper built without use_cuda_graph) is the input error the checked path raises."""
        if rc == CAPTURE_REFUSED and self._flags & REFUSE_CAPTURE:
            return InputError(_CAPTURE_MSG)
        return self._mod.error(rc, "fi_batch_decode")

    def _check_pages(self, num_pages: int) -> None:
        if self._impl == "cuda":
            table = self._d_indices
            if table is None:
                off, nnz = self._staged_indices
                table = self._staging.device_buf[off: off + nnz]
        else:
            table = self._indices_in
        checks.index_values("page indices", table[: int(self._host_tables()[0][-1])] if self._batch else table[:0],
                            num_pages, " (the cache's page count)")

    def _run_reference(self, q, paged_kv_cache, sm_mul, ks, vs, wl, out, lse):
        o, s = batch_decode_reference(
            q, paged_kv_cache, torch.from_numpy(self._host_tables()[0]), self._indices_in.cpu(),
            torch.from_numpy(self._host_tables()[1]), self._kv_layout, return_lse=True,
            sm_scale=self._sm_scale * sm_mul, logits_soft_cap=self._cap or None, window_left=wl,
            pos_encoding_mode=self._pos, rope_scale=self._rope_scale, rope_theta=self._rope_theta,
            k_scale=ks, v_scale=vs)
        out.copy_(o)
        if lse is not None:
            lse.copy_(s)

    def forward(self, q, paged_kv_cache, pos_encoding_mode: Optional[str] = None, q_scale=None,
                k_scale=None, v_scale=None, window_left: Optional[int] = None, logits_soft_cap=None,
                sm_scale=None, rope_scale=None, rope_theta=None, return_lse: bool = False):
        """Legacy alias of run(). The attention options are begin_forward's / plan()'s: one given
        here must equal the planned one (InputError otherwise); ``window_left`` overrides as in
        run()."""
        if not self._planned:
            raise InputError("run() called before plan()")
        options.check_forward_options(
            {"pos_encoding_mode": self._pos, "logits_soft_cap": self._cap, "sm_scale": self._sm_scale,
             "rope_scale": self._rope_scale, "rope_theta": self._rope_theta}, self._d,
            pos_encoding_mode=pos_encoding_mode, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
            rope_scale=rope_scale, rope_theta=rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                        window_left=window_left, return_lse=return_lse)

    def forward_return_lse(self, q, paged_kv_cache, **kw):
        return self.forward(q, paged_kv_cache, return_lse=True, **kw)

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
