"""Segment GEMM (LoRA, FlashInfer's SegmentGEMMWrapper) and grouped GEMM over row segments
(``grouped_mm_bf16``, used by fi-moe).

Both lower to one destination-passing core: rows ``seg_indptr[s] .. seg_indptr[s+1]`` of x times
``W[weight_indices[s]]^T``. The CUDA backend is the decode kernel in segment mode (16-row tiles
of each segment, W streamed with 16-byte loads, tensor-core MMAs), graph-safe: segment lengths are
read on the device. It suits LoRA (few rows or small N per segment); large grouped problems
(MoE prefill) are a job for a grouped CUTLASS kernel, not yet here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from fi_core import Backend, OpInfo, arch_of, checks, current_stream, knobs, load, on_device, register_op
from fi_core.launch import CallMemo, current_device, raw_stream
from fi_core.errors import InputError, InputTypeError, UnsupportedError

from ..dense.spec import gemv_spec
from .reference import segment_gemm_reference

_16BIT = (torch.bfloat16, torch.float16)
_INDEX = (torch.int32, torch.int64)


def _seg_check(f: dict) -> Optional[str]:
    if not f.get("k_ok", True):
        return "needs K-contiguous x and weights with 16-byte aligned rows"
    return None


SEGMENT_GEMM = register_op(OpInfo(
    name="segment_gemm", family="fi-gemm", api="flashinfer.gemm.SegmentGEMMWrapper",
    backends=(
        Backend("gemv_segment", min_arch="8.0", dtypes=_16BIT, check=_seg_check,
                notes="16-row tiles per segment, weight-streaming mma.sync"),
        Backend("reference", devices=("cpu", "cuda"), notes="pure torch, fp32 math; synchronises"),
    ),
    specs=lambda arch: [gemv_spec(torch.bfloat16, torch.bfloat16, torch.bfloat16, arch)],
))

_CHOICE: dict = {}
# Recorded call signatures of SegmentGEMMWrapper.run (as fi_gemm.dense.api._FAST; see there): a
# call the checked path served with the kernel, without copies or conversions, with seg_indptr
# and its own output, is repeated by later calls with the same signature straight at the launch.
_FAST = CallMemo()
_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling


def reset_dispatch() -> None:
    """Forget the dispatch memos (backend choices and recorded fast calls)."""
    _CHOICE.clear()
    _FAST.clear()


def _fast_key(x, weights, batch_size, weight_column_major, seg_indptr, weight_indices, backend) -> tuple:
    """Every property of a run() call its checks and dispatch read, except data pointers."""
    wi = weight_indices
    return (x.shape, x.stride(), weights.shape, weights.stride(), x.dtype, weights.dtype, batch_size,
            weight_column_major, seg_indptr.shape, seg_indptr.stride(), seg_indptr.dtype, seg_indptr.get_device(),
            None if wi is None else (wi.shape, wi.stride(), wi.dtype, wi.get_device()), backend,
            x.get_device(), weights.get_device())


def _k_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    v = 16 // x.element_size()
    k = x.shape[1]
    ldx = x.stride(0) if x.shape[0] > 1 else k
    return (k % v == 0 and x.stride(1) == 1 and w.stride(2) == 1 and ldx % v == 0
            and w.stride(1) % v == 0 and w.stride(0) % v == 0
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def _segment_dispatch(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                      seg_indptr: torch.Tensor, weight_indices: Optional[torch.Tensor],
                      backend: str):
    """Runs the segment GEMM into ``out``; returns (launcher, int args) of a kernel launch, else
    None."""
    dev = x.device
    if dev.type != "cuda" or backend == "reference":
        name = "reference"
    else:
        k_ok = _k_ok(x, w)
        key = (dev.index, x.dtype, out.dtype, k_ok, backend)
        name = _CHOICE.get(key)
        if name is None:
            name = _CHOICE[key] = SEGMENT_GEMM.choose(dev, x.dtype, requested=backend,
                                                      k_ok=k_ok).name
    if name == "reference" or x.shape[1] == 0:
        if x.shape[1] == 0:
            out.zero_()
            return None
        segment_gemm_reference(x, w, seg_indptr, weight_indices, out)
        return None
    total, k = x.shape
    n = w.shape[1]
    mod = load(gemv_spec(x.dtype, w.dtype, out.dtype, arch_of(dev)))
    args = (total, seg_indptr.shape[0] - 1, n, k, x.stride(0) if total > 1 else k, w.stride(1), out.stride(0),
            w.stride(0), 0, 0, 0, 0, 0)
    with on_device(dev):
        mod.fi_gemv_segment(out.data_ptr(), x.data_ptr(), w.data_ptr(), seg_indptr.data_ptr(),
                            weight_indices.data_ptr() if weight_indices is not None else None,
                            None, None, *args, current_stream(dev))
    return mod.fi_gemv_segment, args


@torch.library.custom_op("fi_gemm::segment_gemm", mutates_args=("out",))
def _segment_op(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor,
                weight_indices: Optional[torch.Tensor], backend: str) -> None:
    _segment_dispatch(out, x, w, seg_indptr, weight_indices, backend)


@_segment_op.register_fake
def _(out, x, w, seg_indptr, weight_indices, backend) -> None:
    return None


def _run(out, x, w, seg_indptr, weight_indices, backend):
    if torch.compiler.is_compiling():
        torch.ops.fi_gemm.segment_gemm(out, x, w, seg_indptr, weight_indices, backend)
        return None
    return _segment_dispatch(out, x, w, seg_indptr, weight_indices, backend)


def _index(name: str, t: torch.Tensor, length: int, device) -> torch.Tensor:
    checks.tensor(name, t)
    checks.dtype(name, t, _INDEX)
    checks.shape(name, t, (length,))
    if t.device != device:
        raise InputError(f"{name} must be on {device} like x, got {t.device}")
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _check_indptr_values(seg_indptr: torch.Tensor, total: int, weight_indices, num_w: int) -> None:
    """Expensive (synchronising) checks, only with FI_CHECK_INPUTS=1."""
    ip = seg_indptr.tolist()
    if ip[0] < 0 or ip[-1] > total or any(b < a for a, b in zip(ip, ip[1:])):
        raise InputError(f"seg_indptr must be non-decreasing within [0, {total}], got {ip}")
    if weight_indices is not None:
        wi = weight_indices.tolist()
        if any(i < 0 or i >= num_w for i in wi):
            raise InputError(f"weight_indices must lie in [0, {num_w}), got {wi}")


def _segment_gemm(x, w, seg_indptr, weight_indices, out, out_dtype, backend, what):
    device = x.device
    total, k = x.shape
    n = w.shape[1]
    s = seg_indptr.shape[0] - 1
    if total // 16 + s > 65535 and device.type == "cuda":
        raise UnsupportedError(f"{what}: at most 65535 16-row tiles, got {total} rows in {s} segments")
    if knobs.check_inputs():
        _check_indptr_values(seg_indptr, total, weight_indices, w.shape[0])
    out = checks.output("out", out, (total, n), out_dtype, device)
    if backend in ("auto", "cutlass", "sm80", "sm90", "cudnn"):
        backend = "auto"
    elif backend not in SEGMENT_GEMM.backend_names():
        raise UnsupportedError(f"{what}: unknown backend {backend!r}; choose 'auto' or one of "
                               f"{SEGMENT_GEMM.backend_names()}")
    return out, _run(out, x, w, seg_indptr, weight_indices, backend)


class SegmentGEMMWrapper:
    """Segment GEMM for LoRA: segment i of ``x`` times ``weights[weight_indices[i]]``.

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        Accepted for FlashInfer compatibility (the kernel needs no workspace).
    backend : str
        "auto" (FlashInfer's "sm80"/"sm90" mean the same), "gemv_segment" or "reference".

    Examples
    --------
    >>> import torch
    >>> from fi_gemm import SegmentGEMMWrapper
    >>> seg = SegmentGEMMWrapper(torch.empty(1 << 20, dtype=torch.int8))
    >>> x = torch.randn(10, 64, dtype=torch.bfloat16)
    >>> w = torch.randn(3, 16, 64, dtype=torch.bfloat16)   # [num_weights, d_out, d_in]
    >>> y = seg.run(x, w, 2, True, seg_lens=torch.tensor([4, 6]),
    ...             weight_indices=torch.tensor([2, 0]))
    >>> y.shape
    torch.Size([10, 16])
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto") -> None:
        self._workspace = float_workspace_buffer
        self.backend = backend

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor) -> None:
        self._workspace = float_workspace_buffer

    def run(self, x: torch.Tensor, weights: torch.Tensor, batch_size: int,
            weight_column_major: bool, out: Optional[torch.Tensor] = None,
            seg_lens: Optional[torch.Tensor] = None, seg_indptr: Optional[torch.Tensor] = None,
            weight_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the segment GEMM.

        Parameters
        ----------
        x : torch.Tensor
            [total_rows, d_in], bfloat16 or float16, rows of all segments packed.
        weights : torch.Tensor
            [num_weights, d_out, d_in] if ``weight_column_major`` else [num_weights, d_in, d_out],
            x's dtype. The row-major layout costs one transposed copy of ``weights`` per call.
        batch_size : int
            Number of segments.
        weight_column_major : bool
            Layout of ``weights`` (see above).
        out : torch.Tensor, optional
            [total_rows, d_out], x's dtype. Rows outside every segment are not written.
        seg_lens : torch.Tensor, optional
            [batch_size] int32/int64 segment lengths (one of seg_lens / seg_indptr is required).
        seg_indptr : torch.Tensor, optional
            [batch_size + 1] int32/int64 segment offsets into x's rows.
        weight_indices : torch.Tensor, optional
            [batch_size] int32/int64 index into ``weights`` per segment (default: segment i
            uses weights[i]).

        Returns
        -------
        torch.Tensor
            [total_rows, d_out].
        """
        if (out is None and seg_lens is None and _FAST and type(x) is _Tensor and type(weights) is _Tensor
                and type(seg_indptr) is _Tensor and (weight_indices is None or type(weight_indices) is _Tensor)
                and type(batch_size) is int and type(self.backend) is str):
            hit = _FAST.get(_fast_key(x, weights, batch_size, weight_column_major, seg_indptr, weight_indices,
                                      self.backend))
            if (hit is not None and not (x.data_ptr() % 16 or weights.data_ptr() % 16) and not _compiling()
                    and not knobs.check_inputs()):
                fn, shape, dtype, dev, args = hit
                if dev == current_device():  # else the checked path launches under a device guard
                    res = torch.empty(shape, dtype=dtype, device=dev)
                    fn(res.data_ptr(), x.data_ptr(), weights.data_ptr(), seg_indptr.data_ptr(),
                       None if weight_indices is None else weight_indices.data_ptr(), None, None, *args,
                       raw_stream(dev))
                    return res
        x_in, seg_in, wi_in, out_given = x, seg_indptr, weight_indices, out is not None
        checks.tensor("x", x)
        checks.tensor("weights", weights)
        checks.dtype("x", x, _16BIT)
        if weights.dtype != x.dtype:
            raise InputTypeError(f"weights must have x's dtype {x.dtype}, got {weights.dtype}")
        checks.ndim("x", x, (2,))
        checks.ndim("weights", weights, (3,))
        checks.positive("batch_size", batch_size, allow_zero=True)
        device = checks.same_device(x=x, weights=weights, out=out)
        d_in = x.shape[1]
        if weight_column_major:
            checks.shape("weights", weights, (None, None, d_in), "[num_weights, d_out, d_in]")
            w = weights
        else:
            checks.shape("weights", weights, (None, d_in, None), "[num_weights, d_in, d_out]")
            w = weights.transpose(1, 2)
        if w.stride(2) != 1 and w.shape[2] > 1:
            w = w.contiguous()
        if seg_indptr is None:
            if seg_lens is None:
                raise InputError("one of seg_lens or seg_indptr is required, got neither")
            lens = _index("seg_lens", seg_lens, batch_size, device)
            seg_indptr = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))
        else:
            seg_indptr = _index("seg_indptr", seg_indptr, batch_size + 1, device)
        if weight_indices is not None:
            weight_indices = _index("weight_indices", weight_indices, batch_size, device)
        elif weights.shape[0] < batch_size:
            raise InputError(f"without weight_indices, weights needs >= batch_size ({batch_size}) "
                             f"entries, got {weights.shape[0]}")
        x = x if x.stride(1) == 1 else x.contiguous()
        out, ran = _segment_gemm(x, w, seg_indptr, weight_indices, out, x.dtype, self.backend,
                                 "SegmentGEMMWrapper.run")
        if (ran is not None and not out_given and seg_lens is None and x is x_in and seg_indptr is seg_in
                and weight_indices is wi_in and w.data_ptr() == weights.data_ptr() and raw_stream is not None
                and not knobs.check_inputs()):
            fn, args = ran
            _FAST.put(_fast_key(x, weights, batch_size, weight_column_major, seg_indptr, weight_indices,
                                self.backend), (fn, tuple(out.shape), out.dtype, device.index, args))
        return out

    forward = run


def grouped_mm_bf16(a: torch.Tensor, b: torch.Tensor, m_indptr: torch.Tensor,
                    out: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                    backend: str = "auto", *,
                    m_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Grouped GEMM over row segments: ``out[m_indptr[e]:m_indptr[e+1]] = a[...] @ b[e]^T``.

    Parameters
    ----------
    a : torch.Tensor
        [cum_m, k], bfloat16 or float16.
    b : torch.Tensor
        [num_groups, n, k], a's dtype (K contiguous).
    m_indptr : torch.Tensor
        [num_groups + 1] int32/int64 row offsets.
    out : torch.Tensor, optional
        [cum_m, n] of ``out_dtype``.
    out_dtype : torch.dtype
        bfloat16 (default), float16 or float32.
    m_sizes : sequence of int, optional
        fi extension: the group sizes as host integers, when the caller already has them. Each
        group then runs the dense GEMM path (decode kernel for <= 16 rows, CUTLASS on Hopper for
        more), which reads each group's weight once; without it the graph-safe segment kernel
        re-reads a group's weight per 16-row tile (fine for decode, slow for large groups).
        Must agree with m_indptr (not checked unless FI_CHECK_INPUTS=1).

    Returns
    -------
    torch.Tensor
        [cum_m, n]; rows outside every group are not written.

    Examples
    --------
    >>> import torch
    >>> from fi_gemm import grouped_mm_bf16
    >>> a = torch.randn(6, 32, dtype=torch.bfloat16)
    >>> b = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    >>> grouped_mm_bf16(a, b, torch.tensor([0, 2, 6], dtype=torch.int32)).shape
    torch.Size([6, 8])
    """
    checks.tensor("a", a)
    checks.tensor("b", b)
    checks.dtype("a", a, _16BIT)
    if b.dtype != a.dtype:
        raise InputTypeError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    checks.ndim("a", a, (2,))
    checks.ndim("b", b, (3,))
    checks.shape("b", b, (None, None, a.shape[1]), "[num_groups, n, k]")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputTypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    device = checks.same_device(a=a, b=b, out=out)
    m_indptr = _index("m_indptr", m_indptr, b.shape[0] + 1, device)
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(2) == 1 else b.contiguous()
    if (m_sizes is not None and device.type == "cuda" and out_dtype != torch.float32
            and backend == "auto" and not torch.compiler.is_compiling()):
        return _grouped_by_host_sizes(a, b, m_indptr, list(m_sizes), out, out_dtype)
    return _segment_gemm(a, b, m_indptr, None, out, out_dtype, backend, "grouped_mm_bf16")[0]


def _grouped_by_host_sizes(a, b, m_indptr, sizes, out, out_dtype):
    from ..dense.api import _gemm_dispatch  # noqa: PLC0415

    if len(sizes) != b.shape[0] or sum(sizes) > a.shape[0] or min(sizes, default=0) < 0:
        raise InputError(f"m_sizes must hold {b.shape[0]} non-negative sizes summing to at most "
                         f"{a.shape[0]}, got {sizes}")
    if knobs.check_inputs():
        expect = [0]
        for sz in sizes:
            expect.append(expect[-1] + sz)
        if m_indptr.tolist() != expect:
            raise InputError(f"m_sizes {sizes} disagree with m_indptr {m_indptr.tolist()}")
    out = checks.output("out", out, (a.shape[0], b.shape[1]), out_dtype, a.device)
    r = 0
    for g, sz in enumerate(sizes):
        if sz:
            _gemm_dispatch("mm_bf16", out[r:r + sz], a[r:r + sz], b[g], None, None, None, "auto")
        r += sz
    return out
