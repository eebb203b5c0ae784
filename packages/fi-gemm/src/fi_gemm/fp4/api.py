"""mm_fp4: FP4 (NVFP4 / MXFP4) block-scaled GEMM with FlashInfer's parameters.

FlashInfer runs it on Blackwell's FP4 tensor cores only. Hopper, Ada and Ampere have none, so
here the codes become bf16 with their block scale folded in (exact: code * scale fits bf16) and
go through bf16 tensor-core MMAs with fp32 accumulation, ``alpha`` applied at the end. The result
equals the fp32 reference up to the accumulation order.

Backends, in preference order:

- ``gemv_fp4`` (M <= 16, sm_80+): ``fi_gemv_fp4`` streams the packed weight and reads the packed
  activations, expanding both in registers: 0.56 bytes per weight for NVFP4 instead of a bf16
  weight's 2.
- ``dequant_bf16`` (sm_80+): both operands expanded to bf16 copies, then fi-gemm's bf16 GEMM
  (CUTLASS at M > 16); the copies cost a pass over the FP4 bytes plus a write and a read of 4x as
  many, which large M amortises.
- ``reference``: fp32 torch (CPU always).
"""

from __future__ import annotations

from typing import Optional

import torch

from fi_core import Backend, OpInfo, arch_of, checks, current_stream, load, on_device, register_op
from fi_core.errors import InputError, InputTypeError, UnsupportedError
from fi_core.launch import CallMemo, current_device, raw_stream

from ..dense.api import _check_scale, _gemm_dispatch, _rep_specs
from .reference import LAYOUT_CODE, mm_fp4_reference, sf_shape
from .spec import dequant_spec, gemv_fp4_spec

_OUT = (torch.bfloat16, torch.float16)
_FP4 = tuple(t for t in (torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if t is not None)
_E4M3_SF = (torch.uint8, torch.float8_e4m3fn)
_UE8M0_SF = tuple(t for t in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if t is not None)
# FlashInfer's backend names all mean "the best path we have".
_ALIASES = ("auto", "cudnn", "trtllm", "cutlass", "cute-dsl")


def _gemv_check(f: dict):
    if f.get("m", 0) > 16:
        return f"serves M <= 16 (decode shapes), got M = {f.get('m')}"
    if not f.get("w_ok", True):
        return "needs K % 32 == 0 and 16-byte aligned weight rows (and an even scale address)"
    return None


MM_FP4 = register_op(OpInfo(
    name="mm_fp4", family="fi-gemm", api="flashinfer.gemm.mm_fp4", stability="experimental",
    backends=(Backend("gemv_fp4", min_arch="8.0", check=_gemv_check,
                      notes="M <= 16: packed FP4 weight streamed and expanded in registers"),
              Backend("dequant_bf16", min_arch="8.0",
                      notes="FP4 -> bf16 (exact) then the bf16 GEMM; no FP4 tensor cores before sm_100"),
              Backend("reference", devices=("cpu", "cuda"), notes="fp32 dequantised torch math")),
    specs=lambda arch: [dequant_spec(arch), gemv_fp4_spec(torch.bfloat16, arch),
                        *_rep_specs(torch.bfloat16, torch.bfloat16)(arch)]))


_MODS: dict = {}
# Backend per call class (device, requested backend, M <= 16, whether the weight-streaming kernel
# can take the operands): the registry walk costs more than a decode-shape call on the GPU.
_CHOICE: dict = {}


# Repeat calls of the decode shapes (M <= 16), as in dense/api.py: a checked call that launched the
# weight-streaming kernel on operands it took as they were (no copies) and an output it allocated
# records its signature (every input property the checks and the dispatch read, except the data
# pointers); a later call with that signature tests the pointers' alignment and launches. Host time
# per eager call at M = 1 on an H100 machine (session 44): 16.0 us on this path, 36.8 on the
# checked one, 6.3 us of GPU time.
_FAST = CallMemo()
_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling


def _fp4_key(a, b, a_descale, b_descale, alpha, out_dtype, block_size, use_8x4, backend, use_nvfp4) -> tuple:
    return (a.shape, a.stride(), a.dtype, a.get_device(), b.shape, b.stride(), b.dtype, b.get_device(),
            a_descale.shape, a_descale.stride(), a_descale.dtype, a_descale.get_device(),
            b_descale.shape, b_descale.stride(), b_descale.dtype, b_descale.get_device(),
            None if alpha is None else (type(alpha), alpha.shape, alpha.dtype, alpha.get_device()),
            out_dtype, block_size, use_8x4, backend, use_nvfp4)


def reset_dispatch() -> None:
    """Forget the dispatch memos of mm_fp4 and fp4_quantize (backend per call class, recorded fast
    calls, loaded modules): after an A/B switch changed which module a spec names."""
    from . import quant  # noqa: PLC0415

    _CHOICE.clear()
    _FAST.clear()
    _MODS.clear()
    quant._CHOICE.clear()
    quant._FAST.clear()
    quant._MODS.clear()


def _module(device: torch.device, out_dtype) -> object:
    """The dequantiser (out_dtype None) or the weight-streaming kernel of a device, memoised:
    building a spec hashes its sources, ~50 us, more than the decode-shape GEMM itself."""
    key = (device.index, out_dtype)
    mod = _MODS.get(key)
    if mod is None:
        arch = arch_of(device)
        mod = _MODS[key] = load(dequant_spec(arch) if out_dtype is None else gemv_fp4_spec(out_dtype, arch))
    return mod


def _codes(name: str, t: torch.Tensor) -> torch.Tensor:
    checks.tensor(name, t)
    checks.dtype(name, t, _FP4)
    checks.ndim(name, t, (2,))
    return t.view(torch.uint8)


def _scale_bytes(name: str, t: torch.Tensor, rows: int, cols: int, layout: str,
                 allowed: tuple, device: torch.device) -> torch.Tensor:
    """The scale tensor's bytes in storage order: fp4_quantize's buffer, or its transpose (how
    FlashInfer passes b_descale)."""
    checks.tensor(name, t)
    checks.dtype(name, t, allowed)
    if t.device != device:
        raise InputError(f"{name} must be on {device} like a, got {t.device}")
    if not t.is_contiguous():
        if t.dim() == 2 and t.T.is_contiguous():
            t = t.T
        else:
            raise InputError(f"{name} must be the contiguous scale buffer fp4_quantize returns (or its "
                             f"transpose), got shape {tuple(t.shape)} with strides {t.stride()}")
    pr, pc = sf_shape(rows, cols, layout)
    if t.numel() != pr * pc:
        raise InputError(f"{name} must hold {pr} x {pc} = {pr * pc} scales ({rows} rows x {cols} blocks "
                         f"in the {layout} layout, padded), got {t.numel()} (shape {tuple(t.shape)})")
    return t.reshape(-1).view(torch.uint8)


def _dequant(mod, q: torch.Tensor, sf: torch.Tensor, k: int, block: int, layout: str, ue8m0: bool,
             stream: int) -> torch.Tensor:
    rows = q.shape[0]
    out = torch.empty((rows, k), dtype=torch.bfloat16, device=q.device)
    ldq = q.stride(0) if rows > 1 else q.shape[1]
    mod.fi_fp4_dequant(out.data_ptr(), q.data_ptr(), sf.data_ptr(), rows, k, ldq, k, block,
                       LAYOUT_CODE[layout], int(ue8m0), stream)
    return out


def mm_fp4(a: torch.Tensor, b: torch.Tensor, a_descale: torch.Tensor, b_descale: torch.Tensor,
           alpha: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
           out: Optional[torch.Tensor] = None, block_size: int = 16, use_8x4_sf_layout: bool = False,
           backend: str = "auto", use_nvfp4: bool = True, enable_pdl: bool = True) -> torch.Tensor:
    """FP4 GEMM ``(deq(a) @ deq(b)) * alpha`` with NVFP4 or MXFP4 block scales.

    Parameters
    ----------
    a : torch.Tensor
        [m, k / 2] uint8 (or float4_e2m1fn_x2): packed e2m1 codes, two per byte, row-major.
    b : torch.Tensor
        [k / 2, n], column-major: ``w.T`` of a row-major [n, k / 2] packed weight.
    a_descale : torch.Tensor
        a's block scales as fp4_quantize returns them: [ceil(m, 128), ceil(k / block_size, 4)]
        in the 128x4 layout, or [ceil(m, 8), ...] in the 8x4 layout when ``use_8x4_sf_layout``.
        float8_e4m3fn or uint8 (NVFP4); uint8 UE8M0 (MXFP4).
    b_descale : torch.Tensor
        w's block scales in the 128x4 layout, as returned for w or transposed (``sf.T``).
    alpha : torch.Tensor, optional
        One-element float32 tensor multiplied into the result (NVFP4: ``1 / (global_scale_a *
        global_scale_b)``); None means 1.
    out_dtype : torch.dtype
        bfloat16 (default) or float16.
    out : torch.Tensor, optional
        [m, n] of ``out_dtype``.
    block_size : int
        16 with ``use_nvfp4=True``, 32 with ``use_nvfp4=False`` (MXFP4).
    use_8x4_sf_layout : bool
        a_descale in the 8x4 layout (b_descale is always 128x4).
    backend : str
        FlashInfer's names ("auto", "cudnn", "trtllm", "cutlass", "cute-dsl") pick the best path;
        "gemv_fp4", "dequant_bf16" or "reference" force one.
    use_nvfp4 : bool
        NVFP4 (e4m3 scales per 16) or MXFP4 (UE8M0 scales per 32).
    enable_pdl : bool
        Accepted for compatibility.

    Returns
    -------
    torch.Tensor
        [m, n] of ``out_dtype``: fp32 accumulation, one rounding.

    Examples
    --------
    >>> import torch
    >>> from fi_gemm import mm_fp4, fp4_quantize
    >>> x, w = torch.randn(4, 64), torch.randn(32, 64)
    >>> a, sa = fp4_quantize(x)
    >>> b, sb = fp4_quantize(w)
    >>> mm_fp4(a, b.T, sa, sb.T).shape
    torch.Size([4, 32])

    See Also
    --------
    fp4_quantize, nvfp4_quantize, mxfp4_quantize : make the operands.
    """
    if (out is None and _FAST and type(a) is _Tensor and type(b) is _Tensor and type(a_descale) is _Tensor
            and type(b_descale) is _Tensor and (alpha is None or type(alpha) is _Tensor) and type(backend) is str):
        hit = _FAST.get(_fp4_key(a, b, a_descale, b_descale, alpha, out_dtype, block_size, use_8x4_sf_layout,
                                 backend, use_nvfp4))
        if hit is not None and not _compiling():
            fn, shape, dev, args = hit
            ap, bp, sap, sbp = a.data_ptr(), b.data_ptr(), a_descale.data_ptr(), b_descale.data_ptr()
            if dev == current_device() and not (ap % 16 or bp % 16 or sap % 2 or sbp % 2):
                out = torch.empty(shape, dtype=out_dtype, device=dev)
                fn(out.data_ptr(), ap, sap, bp, sbp, None if alpha is None else alpha.data_ptr(), *args,
                   raw_stream(dev))
                return out
    allocated = out is None
    a_in, b_in = a, b
    a = _codes("a", a)
    b = _codes("b", b)
    m, half = a.shape
    if b.shape[0] != half:
        raise InputError(f"b must be [k / 2, n] = [{half}, n] to match a [{m}, {half}], got {tuple(b.shape)}")
    n, k = b.shape[1], 2 * half
    if use_nvfp4 and block_size != 16:
        raise UnsupportedError(f"NVFP4 (use_nvfp4=True) has block_size 16, got {block_size}")
    if not use_nvfp4 and block_size != 32:
        raise UnsupportedError(f"MXFP4 (use_nvfp4=False) has block_size 32, got {block_size}")
    if k % block_size:
        raise InputError(f"k = {k} (2 x a.shape[1]) must be a multiple of block_size = {block_size}")
    if out_dtype not in _OUT:
        raise InputTypeError(f"out_dtype must be bfloat16 or float16, got {out_dtype}")
    device = checks.same_device(a=a, b=b, out=out)
    a_layout = "8x4" if use_8x4_sf_layout else "128x4"
    allowed = _E4M3_SF if use_nvfp4 else _UE8M0_SF
    cols = k // block_size
    sa = _scale_bytes("a_descale", a_descale, m, cols, a_layout, allowed, device)
    sb = _scale_bytes("b_descale", b_descale, n, cols, "128x4", allowed, device)
    if alpha is not None:
        _check_scale("alpha", alpha, device)
    if backend in _ALIASES:
        backend = "auto"
    elif backend not in MM_FP4.backend_names():
        raise UnsupportedError(f"mm_fp4: unknown backend {backend!r}; choose 'auto', one of "
                               f"{MM_FP4.backend_names()}, or a FlashInfer name {list(_ALIASES)}")
    out = checks.output("out", out, (m, n), out_dtype, device)
    w = b.T  # [n, k / 2], K contiguous when b is column-major
    if w.stride(-1) != 1 and half > 1:
        w = w.contiguous()  # b given row-major: correct, one transposed copy per call
    a = a if a.stride(-1) == 1 or half <= 1 else a.contiguous()
    if torch.compiler.is_compiling():
        torch.ops.fi_gemm.mm_fp4(out, a, w, sa, sb, alpha, block_size, use_nvfp4, use_8x4_sf_layout, backend)
        return out
    ran = _mm_fp4_dispatch(out, a, w, sa, sb, alpha, block_size, use_nvfp4, use_8x4_sf_layout, backend)
    if (ran is not None and allocated and raw_stream is not None and a.data_ptr() == a_in.data_ptr()
            and w.data_ptr() == b_in.data_ptr() and sa.data_ptr() == a_descale.data_ptr()
            and sb.data_ptr() == b_descale.data_ptr()):
        _FAST.put(_fp4_key(a_in, b_in, a_descale, b_descale, alpha, out_dtype, block_size, use_8x4_sf_layout,
                           backend, use_nvfp4), (ran[0], tuple(out.shape), device.index, ran[1]))
    return out


def _mm_fp4_dispatch(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, sa: torch.Tensor,
                     sb: torch.Tensor, alpha: Optional[torch.Tensor], block_size: int, use_nvfp4: bool,
                     use_8x4_sf_layout: bool, backend: str):
    """Checked operands in, ``out`` written: a [m, k / 2] and w [n, k / 2] codes with K
    contiguous, sa / sb the scale bytes in storage order, backend "auto" or a registered name.
    Returns (entry, the launch's size arguments) when the weight-streaming kernel ran on a and w
    as given, else None."""
    m, half = a.shape
    n, k = w.shape[0], 2 * half
    a_layout = "8x4" if use_8x4_sf_layout else "128x4"
    device = out.device
    if m == 0 or n == 0:
        return None
    ldw = w.stride(0) if n > 1 else half
    w_ok = (k % 32 == 0 and ldw % 16 == 0 and w.data_ptr() % 16 == 0 and sb.data_ptr() % 2 == 0
            and sa.data_ptr() % 2 == 0)
    key = (device.type, device.index, backend, m <= 16, w_ok)
    name = _CHOICE.get(key)
    if name is None:
        name = _CHOICE[key] = MM_FP4.choose(device, None, requested=backend, m=m, w_ok=w_ok).name
    if name == "reference" or k == 0:
        out.copy_(mm_fp4_reference(a, w, sa, sb, alpha, out.dtype, block_size, not use_nvfp4, a_layout))
        return None
    stream = current_stream(device)
    if name == "gemv_fp4":
        # 16-byte activation loads; k % 32 == 0 here, so a fresh copy's rows qualify
        if a.data_ptr() % 16 or (m > 1 and a.stride(0) % 16):
            a = a.clone(memory_format=torch.contiguous_format)
        lda = a.stride(0) if m > 1 else half
        ldo = out.stride(0) if m > 1 else n
        fn = _module(device, out.dtype).fi_gemv_fp4
        args = (m, n, k, lda, ldw, ldo, block_size, int(not use_nvfp4), int(use_8x4_sf_layout))
        with on_device(device):
            fn(out.data_ptr(), a.data_ptr(), sa.data_ptr(), w.data_ptr(), sb.data_ptr(),
               alpha.data_ptr() if alpha is not None else None, *args, stream)
        return fn, args
    # The dequantiser reads 8 bytes at a time; k % 16 == 0, so a fresh copy's rows qualify.
    if a.data_ptr() % 8 or (m > 1 and a.stride(0) % 8):
        a = a.clone(memory_format=torch.contiguous_format)
    if w.data_ptr() % 8 or (n > 1 and w.stride(0) % 8):
        w = w.clone(memory_format=torch.contiguous_format)
    mod = _module(device, None)
    with on_device(device):
        af = _dequant(mod, a, sa, k, block_size, a_layout, not use_nvfp4, stream)
        wf = _dequant(mod, w, sb, k, block_size, "128x4", not use_nvfp4, stream)
    _gemm_dispatch("mm_bf16", out, af, wf, None, alpha, None, "auto")
    return None


@torch.library.custom_op("fi_gemm::mm_fp4", mutates_args=("out",))
def _mm_fp4_op(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
               alpha: Optional[torch.Tensor], block_size: int, use_nvfp4: bool, use_8x4_sf_layout: bool,
               backend: str) -> None:
    _mm_fp4_dispatch(out, a, w, sa, sb, alpha, block_size, use_nvfp4, use_8x4_sf_layout, backend)


@_mm_fp4_op.register_fake
def _(out, a, w, sa, sb, alpha, block_size, use_nvfp4, use_8x4_sf_layout, backend) -> None:
    return None
