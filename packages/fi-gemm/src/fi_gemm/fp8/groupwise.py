"""Block-scaled FP8 GEMM (DeepSeek-style): gemm_fp8_nt_groupwise and group_gemm_fp8_nt_groupwise.

Scales: activations 1 x 128 (per row and 128-wide K block), weights 128 x 128. In FlashInfer's
``scale_major_mode="K"`` a_scale is [m, kb] and b_scale [nb, kb]; in "MN" they are [kb, m] and
[kb, nb] (kb = ceil(k/128), nb = ceil(n/128)). The kernels take any strides, so both modes run
the same code: we pass the logical [rows, kb] view's strides.

Backends: ``gemv`` (M <= 16 per call or per 16-row segment tile; the decode kernel scaling each
128-wide K block's partial sums, sm_89+); ``cutlass_sm90`` (CUTLASS 3.x blockwise-scaled mainloop,
M > 16, sm_90a; for M % 4 != 0 its scale TMA gets a copy of a_scale padded to 4-column rows);
``mma_sm89`` (128 x 128 tiles on mma.sync, each K block's partial sums scaled, sm_89+: the M > 16
path of Ada); else ``reference`` (fp32 dequantised torch math, correct at every M, including
M = 1). The grouped op has no CUTLASS path yet.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from fi_core import Backend, OpInfo, arch_of, checks, current_stream, load, on_device, register_op
from fi_core.launch import CallMemo, current_device, raw_stream
from fi_core.errors import InputError, InputTypeError, UnsupportedError

from ..dense.spec import FP8, gemv_spec
from . import spec as _spec
from .spec import blockwise_config, blockwise_sm89_spec, blockwise_sm90_spec
from .reference import groupwise_reference

_OUT = (torch.bfloat16, torch.float16)


def _gemv_check(f: dict) -> Optional[str]:
    if f.get("m", 0) > 16 and not f.get("segmented"):
        return f"serves M <= 16, got M = {f.get('m')}"
    if not f.get("k_ok", True):
        return "needs K-contiguous operands with 16-byte aligned rows (K % 16 == 0)"
    arch = f.get("arch")
    if arch is not None and arch.cc < 89:
        return "fp8 tensor-core MMA needs sm_89 or newer"
    return None


def _sm90_check(f: dict) -> Optional[str]:
    if f.get("segmented"):
        return "grouped block-scaled CUTLASS kernel not available yet"
    if not f.get("k_ok", True):
        return "TMA needs K-contiguous operands with 16-byte aligned rows (K % 16 == 0)"
    if not f.get("d_ok", True):
        return "TMA needs a row-major output with 16-byte aligned rows (N % 8 == 0)"
    return None


def _mma_check(f: dict) -> Optional[str]:
    if f.get("segmented"):
        return "serves one GEMM, not row segments"
    if not f.get("k_ok", True):
        return "needs K-contiguous operands with 16-byte aligned rows (K % 16 == 0)"
    return None


def _backends(grouped: bool):
    cutlass = () if grouped else (
        Backend("cutlass_sm90", archs=("9.0a",), dtypes=FP8, check=_sm90_check,
                notes="CUTLASS 3.x blockwise-scaled TMA warp-specialised GEMM"),
        Backend("mma_sm89", min_arch="8.9", dtypes=FP8, check=_mma_check,
                notes="block-scaled mma.sync tiles, M > 16 off Hopper"),)
    return (Backend("gemv", min_arch="8.9", dtypes=FP8, check=_gemv_check,
                    notes="block-scaled weight-streaming mma.sync, M <= 16 (per segment tile)"),
            *cutlass,
            Backend("reference", devices=("cpu", "cuda"), notes="fp32 dequantised torch math"))


GEMM_FP8_GROUPWISE = register_op(OpInfo(
    name="gemm_fp8_nt_groupwise", family="fi-gemm", api="flashinfer.gemm.gemm_fp8_nt_groupwise",
    backends=_backends(grouped=False), stability="experimental",
    specs=lambda arch: ([gemv_spec(FP8[0], FP8[0], torch.bfloat16, arch),
                         blockwise_sm89_spec(FP8[0], FP8[0], torch.bfloat16, arch)] if arch.cc >= 89 else [])
    + ([blockwise_sm90_spec(FP8[0], FP8[0], torch.bfloat16, c, arch) for c in ("default", "swizzled")]
       if arch.cc == 90 else [])))
GROUP_GEMM_FP8_GROUPWISE = register_op(OpInfo(
    name="group_gemm_fp8_nt_groupwise", family="fi-gemm",
    api="flashinfer.gemm.group_gemm_fp8_nt_groupwise", backends=_backends(grouped=True),
    stability="experimental",
    specs=lambda arch: [gemv_spec(FP8[0], FP8[0], torch.bfloat16, arch)] if arch.cc >= 89 else []))

_CHOICE: dict = {}
_WS_SIZE: dict = {}
_WS: dict = {}
# Recorded call signatures (as fi_gemm.dense.api._FAST; see there): gemm_fp8_nt_groupwise calls
# that a checked call served with a kernel of ours without copying anything go straight to the
# launch when they come again. Values: (kind, fn, out shape, device index, int args, need), kind
# "gemv" (the mma_sm89 unit too: the same arguments) or "sm90" (whose workspace of `need` bytes
# is looked up per call).
_FAST = CallMemo()
_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling


def _fast_key(a, b, a_scale, b_scale, mode, out_dtype, backend, granularity) -> tuple:
    """Every property of a call the checks and the dispatch read, except data pointers (their
    alignment is tested per call), plus the large-M unit override of A/B runs."""
    return (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a_scale.shape, a_scale.stride(),
            a_scale.dtype, b_scale.shape, b_scale.stride(), b_scale.dtype, mode, out_dtype, backend,
            granularity, a.get_device(), b.get_device(), a_scale.get_device(), b_scale.get_device(),
            _spec.BLOCKWISE_LARGE)


def reset_dispatch() -> None:
    """Forget the dispatch memos (backend choices and recorded fast calls)."""
    _CHOICE.clear()
    _FAST.clear()


def _choose(op: OpInfo, dev, dtype, m, k_ok, segmented, backend, d_ok=True) -> str:
    if dev.type != "cuda":
        return "reference"
    key = (op.name, dev.index, dtype, m <= 16, k_ok, d_ok, backend)
    name = _CHOICE.get(key)
    if name is None:
        name = _CHOICE[key] = op.choose(dev, dtype, requested=backend, m=m, k_ok=k_ok,
                                        d_ok=d_ok, segmented=segmented).name
    return name


def _k_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    k = a.shape[-1]
    lda = a.stride(-2) if a.shape[-2] > 1 else k
    return (k % 16 == 0 and a.stride(-1) == 1 and w.stride(-1) == 1 and lda % 16 == 0
            and all(s % 16 == 0 for s in w.stride()[:-1])
            and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def _backend(backend: str, op: OpInfo) -> str:
    if backend in ("auto", "cutlass", "trtllm", "deepgemm"):
        return "auto"
    if backend not in op.backend_names():
        raise UnsupportedError(f"{op.name}: unknown backend {backend!r}; choose 'auto' or one of "
                               f"{op.backend_names()}")
    return backend


def _check_granularity(g) -> None:
    if tuple(g) != (1, 128, 128):
        raise UnsupportedError(f"scale_granularity_mnk must be (1, 128, 128), got {tuple(g)}")


def _scale(name: str, s, expected: tuple, device) -> torch.Tensor:
    checks.tensor(name, s)
    if s.dtype != torch.float32:
        raise InputTypeError(f"{name} must be float32, got {str(s.dtype).replace('torch.', '')}")
    checks.shape(name, s, expected)
    if s.device != device:
        raise InputError(f"{name} must be on {device}, got {s.device}")
    return s


# ------------------------------------------------------------------------------------------
def _gemm_dispatch(out, a, b, sa, sb, backend):
    """out [m, n] = blockscaled(a [m, k], b [n, k]); sa [m, kb], sb [nb, kb] (any strides).
    Returns (kind, launcher, int args, workspace bytes) of a kernel launch made without copies
    (what a fast call repeats), else None."""
    m, k = a.shape
    n = b.shape[0]
    d_ok = n % 8 == 0 and (out.stride(0) % 8 == 0 or m == 1) and out.data_ptr() % 16 == 0
    name = _choose(GEMM_FP8_GROUPWISE, a.device, a.dtype, m, _k_ok(a, b), False, backend, d_ok)
    if m == 0 or n == 0:
        return None
    if name == "reference":
        out.copy_(groupwise_reference(a, b, sa, sb, out.dtype))
        return None
    if name == "cutlass_sm90":
        # CUTLASS takes MN-major scales: sfa [kb, m], sfb [kb, nb], contiguous, 16-byte aligned
        # (a view of the caller's tensor in "MN" mode; a small transposed copy in "K" mode). The
        # scale TMA needs 16-byte rows of sfa: for M % 4 != 0 the copy has rows of ldsfa = M
        # rounded up to 4 (its padding is loaded with the last M tile and never stored).
        sfa, sfb = sa.T, sb.T
        copied = False
        ldsfa = m
        if m % 4:
            ldsfa = m + 4 - m % 4
            pad = torch.zeros((sfa.shape[0], ldsfa), dtype=torch.float32, device=a.device)
            pad[:, :m].copy_(sfa)
            sfa, copied = pad, True
        elif not sfa.is_contiguous() or sfa.data_ptr() % 16:
            sfa, copied = sfa.contiguous(), True
        if not sfb.is_contiguous() or sfb.data_ptr() % 16:
            sfb, copied = sfb.contiguous(), True
        # Unit per call (by shape; spec.BLOCKWISE_LARGE, read each time, overrides it for A/B runs).
        mod = load(blockwise_sm90_spec(a.dtype, b.dtype, out.dtype, blockwise_config(m, n, k),
                                       arch_of(a.device)))
        key = (id(mod), m, n, k)
        need = _WS_SIZE.get(key)
        if need is None:
            box = ctypes.c_int64(0)
            mod.fi_gemm_blockwise_sm90_workspace(ctypes.addressof(box), m, n, k)
            need = _WS_SIZE[key] = int(box.value)
        ws, ws_bytes = 0, 0
        if need:
            buf = _WS.get(a.device.index)
            if buf is None or buf.numel() < need:
                buf = _WS[a.device.index] = torch.empty(max(need, 1 << 20), dtype=torch.uint8,
                                                        device=a.device)
            ws, ws_bytes = buf.data_ptr(), buf.numel()
        dims = (m, n, k, a.stride(0) if m > 1 else k, b.stride(0) if n > 1 else k,
                out.stride(0) if m > 1 else n, ldsfa)
        with on_device(a.device):
            mod.fi_gemm_blockwise_sm90(out.data_ptr(), a.data_ptr(), b.data_ptr(), sfa.data_ptr(),
                                       sfb.data_ptr(), *dims, ws, ws_bytes, current_stream(a.device))
        return None if copied else ("sm90", mod.fi_gemm_blockwise_sm90, dims, need)
    args = (m, n, k, a.stride(0) if m > 1 else k, b.stride(0) if n > 1 else k, out.stride(0) if m > 1 else n,
            sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
    if name == "mma_sm89":  # same arguments as the decode kernel's block-scale entry
        fn = load(blockwise_sm89_spec(a.dtype, b.dtype, out.dtype, arch_of(a.device))).fi_gemm_blockwise_sm89
    else:
        fn = load(gemv_spec(a.dtype, b.dtype, out.dtype, arch_of(a.device))).fi_gemv_blockscaled
    with on_device(a.device):
        fn(out.data_ptr(), a.data_ptr(), b.data_ptr(), sa.data_ptr(), sb.data_ptr(), *args, current_stream(a.device))
    return "gemv", fn, args, 0


@torch.library.custom_op("fi_gemm::gemm_fp8_groupwise", mutates_args=("out",))
def _gemm_op(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor,
             sb: torch.Tensor, backend: str) -> None:
    _gemm_dispatch(out, a, b, sa, sb, backend)


@_gemm_op.register_fake
def _(out, a, b, sa, sb, backend) -> None:
    return None


def gemm_fp8_nt_groupwise(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                          b_scale: torch.Tensor, scale_major_mode: Optional[str] = None,
                          mma_sm: int = 1,
                          scale_granularity_mnk: tuple[int, int, int] = (1, 128, 128),
                          out: Optional[torch.Tensor] = None,
                          out_dtype: Optional[torch.dtype] = None,
                          backend: str = "cutlass") -> torch.Tensor:
    """FP8 GEMM ``a @ b^T`` with DeepSeek-style block scales (1 x 128 for a, 128 x 128 for b).

    Parameters
    ----------
    a : torch.Tensor
        [m, k], float8_e4m3fn or float8_e5m2, row-major.
    b : torch.Tensor
        [n, k], fp8, K contiguous ("column-major" in FlashInfer's words).
    a_scale : torch.Tensor
        float32, [m, kb] for scale_major_mode "K", [kb, m] for "MN" (kb = ceil(k / 128)).
    b_scale : torch.Tensor
        float32, [nb, kb] for "K", [kb, nb] for "MN" (nb = ceil(n / 128)).
    scale_major_mode : {"MN", "K"}, optional
        Layout of the scales; None means "MN".
    mma_sm : int
        Accepted for FlashInfer compatibility (1 or 2); ignored.
    scale_granularity_mnk : tuple
        Must be (1, 128, 128).
    out : torch.Tensor, optional
        [m, n] of ``out_dtype``.
    out_dtype : torch.dtype, optional
        bfloat16 (default) or float16.
    backend : str
        FlashInfer's "cutlass"/"trtllm" and "auto" pick the best kernel; "gemv" or "reference"
        force one.

    Returns
    -------
    torch.Tensor
        [m, n]: ``sum_kb (a_blk @ b_blk^T) * a_scale[m, kb] * b_scale[n // 128, kb]``.

    Examples
    --------
    >>> import torch
    >>> from fi_gemm import gemm_fp8_nt_groupwise, quantize_fp8_block, quantize_fp8_per_token_group
    >>> a, sa = quantize_fp8_per_token_group(torch.randn(2, 256), scale_major_mode="MN")
    >>> b, sb = quantize_fp8_block(torch.randn(128, 256), scale_major_mode="MN")
    >>> gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="MN").shape
    torch.Size([2, 128])
    """
    if (out is None and _FAST and type(a) is _Tensor and type(b) is _Tensor and type(a_scale) is _Tensor
            and type(b_scale) is _Tensor and type(scale_granularity_mnk) is tuple
            and scale_granularity_mnk == (1, 128, 128) and type(backend) is str
            and scale_major_mode in (None, "MN", "K")):
        key = _fast_key(a, b, a_scale, b_scale, scale_major_mode, out_dtype, backend, scale_granularity_mnk)
        hit = _FAST.get(key)
        if (hit is not None and not (a.data_ptr() % 16 or b.data_ptr() % 16 or a_scale.data_ptr() % 16
                                     or b_scale.data_ptr() % 16) and not _compiling()):
            kind, fn, shape, dev, args, need = hit
            ws = None
            if dev != current_device():  # another GPU than the current one: the checked path guards it
                hit = None
            elif kind == "sm90":
                ws = _WS.get(dev) if need else None
                if need and (ws is None or ws.numel() < need):
                    hit = None
            if hit is not None:
                res = torch.empty(shape, dtype=torch.bfloat16 if out_dtype is None else out_dtype, device=dev)
                if kind == "gemv":
                    fn(res.data_ptr(), a.data_ptr(), b.data_ptr(), a_scale.data_ptr(), b_scale.data_ptr(), *args,
                       raw_stream(dev))
                else:
                    fn(res.data_ptr(), a.data_ptr(), b.data_ptr(), a_scale.data_ptr(), b_scale.data_ptr(), *args,
                       0 if ws is None else ws.data_ptr(), 0 if ws is None else ws.numel(), raw_stream(dev))
                return res
    out_given, out_dtype_arg = out is not None, out_dtype
    _check_granularity(scale_granularity_mnk)
    mode = "MN" if scale_major_mode is None else scale_major_mode
    if mode not in ("MN", "K"):
        raise InputError(f"scale_major_mode must be 'MN' or 'K', got {scale_major_mode!r}")
    checks.tensor("a", a)
    checks.tensor("b", b)
    checks.dtype("a", a, FP8)
    checks.dtype("b", b, FP8)
    checks.ndim("a", a, (2,))
    checks.ndim("b", b, (2,))
    m, k = a.shape
    checks.shape("b", b, (None, k), "k must match a")
    n = b.shape[0]
    kb, nb = -(-k // 128), -(-n // 128)
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in _OUT:
        raise InputTypeError(f"out_dtype must be bfloat16 or float16, got {out_dtype}")
    device = checks.same_device(a=a, b=b, a_scale=a_scale, b_scale=b_scale, out=out)
    if mode == "K":
        sa = _scale("a_scale", a_scale, (m, kb), device)
        sb = _scale("b_scale", b_scale, (nb, kb), device)
    else:
        sa = _scale("a_scale", a_scale, (kb, m), device).T
        sb = _scale("b_scale", b_scale, (kb, nb), device).T
    be = _backend(backend, GEMM_FP8_GROUPWISE)
    out = checks.output("out", out, (m, n), out_dtype, device)
    a_in, b_in = a, b
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    if torch.compiler.is_compiling():
        torch.ops.fi_gemm.gemm_fp8_groupwise(out, a, b, sa, sb, be)
        return out
    ran = _gemm_dispatch(out, a, b, sa, sb, be)
    if (ran is not None and not out_given and a is a_in and b is b_in and raw_stream is not None
            and type(scale_granularity_mnk) is tuple):
        key = _fast_key(a, b, a_scale, b_scale, scale_major_mode, out_dtype_arg, backend, scale_granularity_mnk)
        kind, fn, args, need = ran
        _FAST.put(key, (kind, fn, tuple(out.shape), device.index, args, need))
    return out


# ------------------------------------------------------------------------------------------
def _group_reference(out, a, b, sa, sb, m_indptr) -> None:
    ip = m_indptr.tolist()
    for g in range(len(ip) - 1):
        r0, r1 = ip[g], ip[g + 1]
        if r1 > r0:
            out[r0:r1] = groupwise_reference(a[r0:r1], b[g], sa[r0:r1], sb[g], out.dtype)


def _group_dispatch(out, a, b, sa, sb, m_indptr, backend) -> None:
    """out [cum_m, n]; a [cum_m, k]; b [G, n, k]; sa [cum_m, kb]; sb [G, nb, kb] (any strides)."""
    total, k = a.shape
    n = b.shape[1]
    name = _choose(GROUP_GEMM_FP8_GROUPWISE, a.device, a.dtype, total, _k_ok(a, b), True, backend)
    if total == 0 or n == 0:
        return
    if name == "reference":
        _group_reference(out, a, b, sa, sb, m_indptr)
        return
    mod = load(gemv_spec(a.dtype, b.dtype, out.dtype, arch_of(a.device)))
    with on_device(a.device):
        mod.fi_gemv_segment(out.data_ptr(), a.data_ptr(), b.data_ptr(), m_indptr.data_ptr(), None,
                            sa.data_ptr(), sb.data_ptr(), total, m_indptr.shape[0] - 1, n, k,
                            a.stride(0) if total > 1 else k, b.stride(1), out.stride(0),
                            b.stride(0), sa.stride(0), sa.stride(1), sb.stride(1), sb.stride(2),
                            sb.stride(0), current_stream(a.device))


@torch.library.custom_op("fi_gemm::group_gemm_fp8_groupwise", mutates_args=("out",))
def _group_op(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor,
              sb: torch.Tensor, m_indptr: torch.Tensor, backend: str) -> None:
    _group_dispatch(out, a, b, sa, sb, m_indptr, backend)


@_group_op.register_fake
def _(out, a, b, sa, sb, m_indptr, backend) -> None:
    return None


def group_gemm_fp8_nt_groupwise(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                                b_scale: torch.Tensor, m_indptr: torch.Tensor,
                                scale_granularity_mnk: tuple[int, int, int] = (1, 128, 128),
                                scale_major_mode: str = "MN", mma_sm: int = 1,
                                out: Optional[torch.Tensor] = None,
                                out_dtype: Optional[torch.dtype] = None,
                                backend: str = "auto") -> torch.Tensor:
    """Grouped block-scaled FP8 GEMM: rows ``m_indptr[g]:m_indptr[g+1]`` of a times ``b[g]^T``.

    Parameters
    ----------
    a : torch.Tensor
        [cum_m, k] fp8, row-major.
    b : torch.Tensor
        [G, n, k] fp8, K contiguous.
    a_scale : torch.Tensor
        float32, [cum_m, kb] ("K") or [kb, cum_m] ("MN").
    b_scale : torch.Tensor
        float32, [G, nb, kb] ("K") or [G, kb, nb] ("MN").
    m_indptr : torch.Tensor
        [G + 1] int32/int64 row offsets (any lengths, including 0; no multiple-of-4 rule).
    out, out_dtype : optional
        [cum_m, n] output, bfloat16 (default) or float16. Rows outside every group are not written.

    Returns
    -------
    torch.Tensor
        [cum_m, n].
    """
    _check_granularity(scale_granularity_mnk)
    if scale_major_mode not in ("MN", "K"):
        raise InputError(f"scale_major_mode must be 'MN' or 'K', got {scale_major_mode!r}")
    checks.tensor("a", a)
    checks.tensor("b", b)
    checks.dtype("a", a, FP8)
    checks.dtype("b", b, FP8)
    checks.ndim("a", a, (2,))
    checks.ndim("b", b, (3,))
    total, k = a.shape
    checks.shape("b", b, (None, None, k), "[G, n, k]")
    G, n = b.shape[0], b.shape[1]
    kb, nb = -(-k // 128), -(-n // 128)
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in _OUT:
        raise InputTypeError(f"out_dtype must be bfloat16 or float16, got {out_dtype}")
    device = checks.same_device(a=a, b=b, a_scale=a_scale, b_scale=b_scale, m_indptr=m_indptr,
                                out=out)
    checks.dtype("m_indptr", m_indptr, (torch.int32, torch.int64))
    checks.shape("m_indptr", m_indptr, (G + 1,))
    m_indptr = m_indptr if m_indptr.dtype == torch.int64 else m_indptr.to(torch.int64)
    if scale_major_mode == "K":
        sa = _scale("a_scale", a_scale, (total, kb), device)
        sb = _scale("b_scale", b_scale, (G, nb, kb), device)
    else:
        sa = _scale("a_scale", a_scale, (kb, total), device).T
        sb = _scale("b_scale", b_scale, (G, kb, nb), device).transpose(1, 2)
    if device.type == "cuda" and total // 16 + G > 65535:
        raise UnsupportedError(f"at most 65535 16-row tiles, got {total} rows in {G} groups")
    be = _backend(backend, GROUP_GEMM_FP8_GROUPWISE)
    out = checks.output("out", out, (total, n), out_dtype, device)
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    if torch.compiler.is_compiling():
        torch.ops.fi_gemm.group_gemm_fp8_groupwise(out, a, b, sa, sb, m_indptr, be)
    else:
        _group_dispatch(out, a, b, sa, sb, m_indptr, be)
    return out
