"""FP4 quantisers with FlashInfer's names and parameters: ``fp4_quantize``, ``nvfp4_quantize``,
``mxfp4_quantize`` and ``SfLayout``.

Recipe (the TensorRT-LLM one FlashInfer's kernels use, so scales and codes agree with theirs up
to ties in the last rounding):

- NVFP4 (``sf_vec_size=16``, e4m3 scales): per block of 16, ``scale = e4m3(global_scale * amax /
  6)``; the codes are ``e2m1(x * global_scale / scale)`` (0 where the scale is 0). So
  ``x ~= code * scale / global_scale``: ``global_scale`` is an *encode* scale (typically
  ``448 * 6 / amax(x)``) and mm_fp4's ``alpha`` is ``1 / (global_scale_a * global_scale_b)``.
- MXFP4 (``sf_vec_size=32``, ``sf_use_ue8m0=True``): per block of 32, ``scale = 2 ** ceil(log2(
  amax / 6))`` (the power of two at or above, UE8M0), codes ``e2m1(x / scale)``; a global scale
  is not used.
- e2m1 rounding is to nearest, ties to the even code, saturating at +-6; the sign of a negative
  value that rounds to zero is kept.

On a GPU one kernel does it in a pass over the input (``quant.cu``: same fp32 steps, same bytes);
on the CPU, and as the reference, the torch ops below. A quantiser fused into the kernel that
produces the activations is not provided yet.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

from fi_core import Backend, OpInfo, arch_of, checks, current_stream, load, on_device, register_op
from fi_core.errors import InputError, InputTypeError, UnsupportedError
from fi_core.launch import CallMemo, current_device, raw_stream

from .reference import LAYOUT_CODE, sf_offsets, sf_shape
from .spec import quant_spec

__all__ = ["SfLayout", "fp4_quantize", "mxfp4_quantize", "nvfp4_quantize"]

_IN = (torch.bfloat16, torch.float16, torch.float32)
# e2m1 rounding: code = number of thresholds passed. At a tie the even code wins, so the
# thresholds whose upper neighbour is even (1.0, 2.0, 4.0) count when reached, the others only
# when passed.
_PASSED = (0.25, 1.25, 2.5, 5.0)
_REACHED = (0.75, 1.75, 3.5)


FP4_QUANTIZE = register_op(OpInfo(
    name="fp4_quantize", family="fi-gemm", api="flashinfer.fp4_quantize", stability="experimental",
    backends=(Backend("cuda", min_arch="8.0", notes="one pass: amax, scale, codes, swizzled scale store"),
              Backend("reference", devices=("cpu", "cuda"), notes="torch ops, the same fp32 steps")),
    specs=lambda arch: [quant_spec(arch)]))

_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_MODS: dict = {}
_CHOICE: dict = {}
# Repeat calls (as mm_fp4 and the dense ops do): a checked call that ran the kernel on the input as
# given records its signature; a later call with it tests the data pointer's alignment and
# launches. Host time per eager call of one token on an H100 machine (session 44): 15.0 us on this
# path, 25.1 on the checked one, 2.3 us of GPU time.
_FAST = CallMemo()
_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling


def _quant_key(x, global_scale, sf_vec_size, ue8m0, swizzled, l8) -> tuple:
    gs = None if global_scale is None or ue8m0 else (
        type(global_scale), global_scale.shape, global_scale.dtype, global_scale.get_device())
    return (x.shape, x.stride(), x.dtype, x.get_device(), gs, sf_vec_size, ue8m0, swizzled, l8)


class SfLayout(enum.Enum):
    """Scale-factor layouts (FlashInfer's names): 128 x 4 and 8 x 4 swizzled tiles, or linear."""

    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = 2


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t in _PASSED:
        code += (a > t).to(torch.uint8)
    for t in _REACHED:
        code += (a >= t).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def _block_scales(amax: torch.Tensor, gs: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored scale bytes, the multiplier that maps x onto the code grid) per block, fp32 step by
    step as quant.cu computes them (``amax * (1 / 6)`` is a multiplication in both: torch on CUDA
    would turn ``amax / 6.0`` into one, on the CPU not)."""
    want = amax * (1.0 / 6.0)
    if ue8m0:
        # ceil(log2(want)) exactly: frexp's exponent, one less for a power of two; clamped to
        # UE8M0's range, 0 -> 2^-127, inf -> 2^127, NaN -> the NaN byte 255.
        m, e = torch.frexp(want)
        exp = torch.where(m == 0.5, e - 1, e)
        exp = torch.where(want == 0, -127, exp)
        exp = torch.where(torch.isinf(want), 127, exp).clamp(-127, 127)
        raw = torch.where(torch.isnan(want), 255, exp + 127).to(torch.uint8)
        return raw, torch.pow(2.0, -exp.double()).float()
    q = (gs * want).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # NaN stays NaN
    qf = q.float()
    mult = torch.where(qf > 0, gs / torch.where(qf > 0, qf, torch.ones_like(qf)), torch.zeros_like(qf))
    return q.view(torch.uint8), mult


def fp4_quantize(input: torch.Tensor, global_scale: Optional[torch.Tensor] = None,
                 sf_vec_size: int = 16, sf_use_ue8m0: bool = False,
                 is_sf_swizzled_layout: bool = True, is_sf_8x4_layout: bool = False,
                 enable_pdl: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to packed FP4 (e2m1) with block scales (NVFP4 or MXFP4).

    Parameters
    ----------
    input : torch.Tensor
        [..., k] bfloat16, float16 or float32; ``k`` a multiple of ``sf_vec_size``.
    global_scale : torch.Tensor, optional
        One-element float32 *encode* scale (NVFP4; typically ``448 * 6 / amax``). None means 1.
        Ignored for UE8M0 scales.
    sf_vec_size : int
        16 (NVFP4) or 32 (MXFP4).
    sf_use_ue8m0 : bool
        UE8M0 (power-of-two) scales instead of float8_e4m3fn ones.
    is_sf_swizzled_layout, is_sf_8x4_layout : bool
        Scale layout: "128x4" (default), "8x4", or linear when not swizzled.
    enable_pdl : bool, optional
        Accepted for compatibility.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        Codes uint8 [rows, k / 2] (rows = the product of the leading dims; element 2i in the low
        nibble) and scale bytes uint8: [ceil(rows, 128), ceil(k / sf_vec_size, 4)] for 128x4,
        [ceil(rows, 8), ...] for 8x4, [rows, k / sf_vec_size] linear.

    Examples
    --------
    >>> import torch
    >>> from fi_gemm import fp4_quantize
    >>> x = torch.tensor([[6.0, -3.0, 0.5, 0.0] * 4])
    >>> q, sf = fp4_quantize(x, torch.ones(1))
    >>> q.shape, sf.shape, hex(q[0, 0].item())
    (torch.Size([1, 8]), torch.Size([128, 4]), '0xd7')
    """
    if _FAST and type(input) is _Tensor and (global_scale is None or type(global_scale) is _Tensor):
        hit = _FAST.get(_quant_key(input, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout,
                                   is_sf_8x4_layout))
        if hit is not None and not _compiling():
            fn, dev, qshape, sfshape, use_gs, args = hit
            xp = input.data_ptr()
            if dev == current_device() and not xp % 16:
                q = torch.empty(qshape, dtype=torch.uint8, device=dev)
                sf = torch.empty(sfshape, dtype=torch.uint8, device=dev)
                fn(q.data_ptr(), sf.data_ptr(), xp, global_scale.data_ptr() if use_gs else None, *args,
                   raw_stream(dev))
                return q, sf
    checks.tensor("input", input)
    checks.dtype("input", input, _IN)
    if sf_vec_size not in (16, 32):
        raise InputError(f"sf_vec_size must be 16 (NVFP4) or 32 (MXFP4), got {sf_vec_size}")
    if input.dim() < 1 or input.shape[-1] % sf_vec_size:
        raise InputError(f"input's last dimension must be a multiple of sf_vec_size = {sf_vec_size}, "
                         f"got shape {tuple(input.shape)}")
    k = input.shape[-1]
    x = input.reshape(-1, k)
    gs = None
    if global_scale is not None and not sf_use_ue8m0:
        checks.tensor("global_scale", global_scale)
        if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
            raise InputTypeError(f"global_scale must be a one-element float32 tensor, got "
                                 f"{global_scale.dtype} of shape {tuple(global_scale.shape)}")
        if global_scale.device != x.device:
            raise InputError(f"global_scale must be on {x.device} like input, got {global_scale.device}")
        gs = global_scale.reshape(())
    layout = ("8x4" if is_sf_8x4_layout else "128x4") if is_sf_swizzled_layout else "linear"
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        return fp4_quantize_reference(x, gs, sf_vec_size, sf_use_ue8m0, layout)
    rows = x.shape[0]
    pr, pc = sf_shape(rows, k // sf_vec_size, layout)
    q = torch.empty((rows, k // 2), dtype=torch.uint8, device=x.device)
    sf = torch.empty((pr, pc), dtype=torch.uint8, device=x.device)
    if torch.compiler.is_compiling():
        torch.ops.fi_gemm.fp4_quantize(q, sf, x, gs, sf_vec_size, sf_use_ue8m0, layout)
        return q, sf
    ran = _quantize_dispatch(q, sf, x, gs, sf_vec_size, sf_use_ue8m0, layout)
    if ran is not None and raw_stream is not None and ran[2] == input.data_ptr():
        _FAST.put(_quant_key(input, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout,
                             is_sf_8x4_layout),
                  (ran[0], x.device.index, tuple(q.shape), tuple(sf.shape), gs is not None, ran[1]))
    return q, sf


def fp4_quantize_reference(x: torch.Tensor, gs: Optional[torch.Tensor], sf_vec_size: int, ue8m0: bool,
                           layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops of the recipe (the CPU path and the GPU kernel's reference): x [rows, k],
    gs a 0-d float32 tensor or None, layout "128x4", "8x4" or "linear"."""
    k = x.shape[-1]
    x = x.float()
    rows = x.shape[0]
    gs = torch.ones((), device=x.device) if gs is None else gs
    cols = k // sf_vec_size
    blocks = x.view(rows, cols, sf_vec_size)
    amax = blocks.abs().amax(dim=-1)
    raw, mult = _block_scales(amax, gs, ue8m0)
    codes = _e2m1_codes(blocks * mult.unsqueeze(-1))
    codes = torch.where(torch.isnan(amax).unsqueeze(-1), 0, codes).view(rows, k)  # a NaN block: codes 0
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    pr, pc = sf_shape(rows, cols, layout)
    sf = torch.zeros(pr * pc, dtype=torch.uint8, device=x.device)
    sf[sf_offsets(rows, cols, layout, x.device)] = raw
    return packed, sf.view(pr, pc)


def _quantize_dispatch(q: torch.Tensor, sf: torch.Tensor, x: torch.Tensor, gs: Optional[torch.Tensor],
                       sf_vec_size: int, ue8m0: bool, layout: str):
    """Checked operands in, ``q`` and ``sf`` written. Returns (entry, the launch's size arguments,
    the input's data pointer) when the kernel ran, else None."""
    device = x.device
    name = _CHOICE.get(device)
    if name is None:
        name = _CHOICE[device] = FP4_QUANTIZE.choose(device, x.dtype).name
    if name == "reference" or x.numel() == 0:
        rq, rsf = fp4_quantize_reference(x, gs, sf_vec_size, ue8m0, layout)
        q.copy_(rq)
        sf.copy_(rsf)
        return None
    # 16-byte loads of each block: rows must start 16-byte aligned (k % 16 == 0 makes a fresh copy's do)
    if x.stride(-1) != 1 or x.data_ptr() % 16 or (x.shape[0] > 1 and (x.stride(0) * x.element_size()) % 16):
        x = x.clone(memory_format=torch.contiguous_format)  # contiguous() keeps a misaligned view
    mod = _MODS.get(device.index)
    if mod is None:
        mod = _MODS[device.index] = load(quant_spec(arch_of(device)))
    ldx = x.stride(0) if x.shape[0] > 1 else x.shape[1]
    args = (x.shape[0], x.shape[1], ldx, sf.shape[0], sf.shape[1], sf_vec_size, LAYOUT_CODE[layout], int(ue8m0),
            _DTYPE_CODE[x.dtype])
    with on_device(device):
        mod.fi_fp4_quantize(q.data_ptr(), sf.data_ptr(), x.data_ptr(), gs.data_ptr() if gs is not None else None,
                            *args, current_stream(device))
    return mod.fi_fp4_quantize, args, x.data_ptr()


@torch.library.custom_op("fi_gemm::fp4_quantize", mutates_args=("q", "sf"))
def _quantize_op(q: torch.Tensor, sf: torch.Tensor, x: torch.Tensor, gs: Optional[torch.Tensor],
                 sf_vec_size: int, ue8m0: bool, layout: str) -> None:
    _quantize_dispatch(q, sf, x, gs, sf_vec_size, ue8m0, layout)


@_quantize_op.register_fake
def _(q, sf, x, gs, sf_vec_size, ue8m0, layout) -> None:
    return None


def nvfp4_quantize(a: torch.Tensor, a_global_sf: torch.Tensor,
                   sfLayout: SfLayout = SfLayout.layout_128x4, do_shuffle: bool = False,
                   sf_vec_size: int = 16, enable_pdl: Optional[bool] = None):
    """NVFP4 quantisation (e4m3 scales per 16): ``fp4_quantize`` with a layout enum.

    ``do_shuffle`` (TensorRT-LLM-gen's weight shuffle for its Blackwell kernels) is not
    supported: fi's kernels read the plain layouts.

    Examples
    --------
    >>> import torch
    >>> from fi_gemm import nvfp4_quantize, SfLayout
    >>> q, sf = nvfp4_quantize(torch.randn(4, 64), torch.ones(1), SfLayout.layout_8x4)
    >>> q.shape, sf.shape
    (torch.Size([4, 32]), torch.Size([8, 4]))
    """
    if do_shuffle:
        raise UnsupportedError("nvfp4_quantize: do_shuffle=True (TensorRT-LLM-gen's weight shuffle) "
                               "is not supported; fi's mm_fp4 reads the unshuffled layouts")
    if not isinstance(sfLayout, SfLayout):
        raise InputTypeError(f"sfLayout must be an SfLayout, got {sfLayout!r}")
    return fp4_quantize(a, a_global_sf, sf_vec_size, False, sfLayout != SfLayout.layout_linear,
                        sfLayout == SfLayout.layout_8x4)


def mxfp4_quantize(a: torch.Tensor, enable_pdl: Optional[bool] = None):
    """MXFP4 quantisation: UE8M0 scales per 32 elements in the 128x4 layout.

    Examples
    --------
    >>> import torch
    >>> from fi_gemm import mxfp4_quantize
    >>> q, sf = mxfp4_quantize(torch.full((2, 32), 6.0))
    >>> q.shape, sf.shape, int(sf[0, 0])
    (torch.Size([2, 16]), torch.Size([128, 4]), 127)
    """
    return fp4_quantize(a, None, 32, True, True, False)
