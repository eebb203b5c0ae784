"""RMSNorm, fused add + RMSNorm (plain and Gemma) and LayerNorm: FlashInfer's ``flashinfer.norm``.

Path of a call: validate -> choose a backend (cached per device and dtype) -> CUDA launcher in
``norm.cu`` or the fp32 reference (CPU tensors, float32 input). Under ``torch.compile`` the call
goes through a ``torch.library`` custom op (``fi_sampling::rmsnorm`` ...) with a fake impl.

``enable_pdl`` is accepted for FlashInfer compatibility and ignored: launches are plain
stream-ordered launches (programmatic dependent launch is not used).
"""

from __future__ import annotations

import math

from typing import Optional

import torch

from fi_core import Backend, OpInfo, arch_of, checks, current_stream, load, on_device, register_op
from fi_core.errors import InputError, InputTypeError

from .reference import fused_add_rmsnorm_reference, layernorm_reference, rmsnorm_reference
from .spec import norm_spec

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _op(name: str, api: str, doc: str) -> OpInfo:
    return register_op(OpInfo(
        name=name, family="fi-sampling", api=api, doc=doc,
        backends=(
            Backend("cuda", min_arch="8.0", dtypes=_HALF,
                    notes="single pass, row in registers; any hidden size"),
            Backend("reference", devices=("cpu", "cuda"), notes="pure torch, fp32 math"),
        ),
        specs=lambda arch: [norm_spec(torch.bfloat16, arch), norm_spec(torch.float16, arch)],
    ))


RMSNORM = _op("rmsnorm", "flashinfer.norm.rmsnorm", "x * rsqrt(mean(x^2) + eps) * w")
GEMMA_RMSNORM = _op("gemma_rmsnorm", "flashinfer.norm.gemma_rmsnorm", "rmsnorm with (1 + w)")
FUSED_ADD_RMSNORM = _op("fused_add_rmsnorm", "flashinfer.norm.fused_add_rmsnorm",
                        "residual += x; x = rmsnorm(residual), in place")
GEMMA_FUSED_ADD_RMSNORM = _op("gemma_fused_add_rmsnorm",
                              "flashinfer.norm.gemma_fused_add_rmsnorm",
                              "fused_add_rmsnorm with (1 + w)")
LAYERNORM = _op("layernorm", "flashinfer.norm.layernorm", "LayerNorm, float32 gemma/beta")

_CHOICE: dict = {}


def _backend(op: OpInfo, t: torch.Tensor) -> str:
    key = (op.name, t.device, t.dtype)
    name = _CHOICE.get(key)
    if name is None:
        name = _CHOICE[key] = op.choose(device=t.device, dtype=t.dtype).name
    return name


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    """(s0, s1) of the kernel's row map: row r sits at (r // inner) * s0 + (r % inner) * s1."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


# ---- validation --------------------------------------------------------------------------------

def _check_eps(eps) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise InputTypeError(f"eps must be a float, got {type(eps).__name__}")
    if not 0 <= eps < math.inf:  # NaN fails too
        raise InputError(f"eps must be finite and >= 0, got {eps!r}")


def _check_pdl(enable_pdl) -> None:
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise InputTypeError(f"enable_pdl must be None or a bool, got {type(enable_pdl).__name__}")


def _check_rows(name: str, t, ndims=(2, 3)) -> None:
    checks.tensor(name, t)
    checks.dtype(name, t, _FLOATS)
    checks.ndim(name, t, ndims)
    checks.last_dim_contiguous(name, t)


def _check_like(name: str, t, ref: torch.Tensor, ref_name: str) -> None:
    checks.tensor(name, t)
    if t.dtype != ref.dtype:
        raise InputTypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")
    checks.shape(name, t, tuple(ref.shape), f"the shape of {ref_name}")
    checks.last_dim_contiguous(name, t)


def _check_vector(name: str, t, hidden: int, dtypes) -> None:
    checks.tensor(name, t)
    checks.dtype(name, t, dtypes)
    checks.shape(name, t, (hidden,), "the input's last dimension")
    checks.contiguous(name, t)


def _validate_rms(input, weight, eps, out, enable_pdl, residual=None) -> None:
    _check_rows("input", input)
    if residual is not None:
        _check_like("residual", residual, input, "input")
    _check_vector("weight", weight, input.shape[-1], (input.dtype,))
    if out is not None:
        _check_like("out", out, input, "input")
    checks.same_device(input=input, weight=weight, residual=residual, out=out)
    _check_eps(eps)
    _check_pdl(enable_pdl)


# ---- destination-passing cores -------------------------------------------------------------------

def _rms_cuda(out, input, residual, weight, eps: float, weight_offset: float) -> None:
    if input.numel() == 0:
        return
    hidden = input.shape[-1]
    inner = input.shape[1] if input.dim() == 3 else 1
    mod = load(norm_spec(input.dtype, arch_of(input.device)))
    ro = _row_strides(out)
    ri = _row_strides(input)
    rr = _row_strides(residual) if residual is not None else (0, 0)
    with on_device(input.device):
        mod.fi_rmsnorm(out.data_ptr(), input.data_ptr(),
                       residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                       input.numel() // hidden, hidden, inner, *ro, *ri, *rr, float(eps),
                       float(weight_offset), current_stream(input.device))


def _rms_dispatch(op: OpInfo, out, input, weight, eps: float, weight_offset: float) -> None:
    if input.device.type == "cuda" and _backend(op, input) == "cuda":
        _rms_cuda(out, input, None, weight, eps, weight_offset)
    else:
        out.copy_(rmsnorm_reference(input, weight, eps, weight_offset))


def _fused_dispatch(op: OpInfo, input, residual, weight, eps: float, weight_offset: float) -> None:
    if input.device.type == "cuda" and _backend(op, input) == "cuda":
        _rms_cuda(input, input, residual, weight, eps, weight_offset)
    else:
        normed, r = fused_add_rmsnorm_reference(input, residual, weight, eps, weight_offset)
        residual.copy_(r)
        input.copy_(normed)


def _ln_dispatch(out, input, gemma, beta, eps: float) -> None:
    if input.device.type == "cuda" and _backend(LAYERNORM, input) == "cuda":
        if input.numel() == 0:
            return
        mod = load(norm_spec(input.dtype, arch_of(input.device)))
        with on_device(input.device):
            mod.fi_layernorm(out.data_ptr(), input.data_ptr(), gemma.data_ptr(), beta.data_ptr(),
                             input.shape[0], input.shape[1], out.stride(0), input.stride(0),
                             float(eps), current_stream(input.device))
    else:
        out.copy_(layernorm_reference(input, gemma, beta, eps))


_OPS_BY_OFFSET = {0.0: (RMSNORM, FUSED_ADD_RMSNORM), 1.0: (GEMMA_RMSNORM, GEMMA_FUSED_ADD_RMSNORM)}


@torch.library.custom_op("fi_sampling::rmsnorm", mutates_args=("out",))
def _rmsnorm_op(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float,
                weight_offset: float) -> None:
    _rms_dispatch(_OPS_BY_OFFSET[weight_offset][0], out, input, weight, eps, weight_offset)


@_rmsnorm_op.register_fake
def _(out, input, weight, eps, weight_offset) -> None:
    return None


@torch.library.custom_op("fi_sampling::fused_add_rmsnorm", mutates_args=("input", "residual"))
def _fused_add_rmsnorm_op(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float, weight_offset: float) -> None:
    _fused_dispatch(_OPS_BY_OFFSET[weight_offset][1], input, residual, weight, eps, weight_offset)


@_fused_add_rmsnorm_op.register_fake
def _(input, residual, weight, eps, weight_offset) -> None:
    return None


@torch.library.custom_op("fi_sampling::layernorm", mutates_args=("out",))
def _layernorm_op(out: torch.Tensor, input: torch.Tensor, gemma: torch.Tensor, beta: torch.Tensor,
                  eps: float) -> None:
    _ln_dispatch(out, input, gemma, beta, eps)


@_layernorm_op.register_fake
def _(out, input, gemma, beta, eps) -> None:
    return None


def _rms_public(input, weight, eps, out, enable_pdl, weight_offset: float) -> torch.Tensor:
    _validate_rms(input, weight, eps, out, enable_pdl)
    if out is None:
        out = torch.empty_like(input)
    if torch.compiler.is_compiling():
        torch.ops.fi_sampling.rmsnorm(out, input, weight, float(eps), weight_offset)
    else:
        _rms_dispatch(_OPS_BY_OFFSET[weight_offset][0], out, input, weight, float(eps),
                      weight_offset)
    return out


def _fused_public(input, residual, weight, eps, enable_pdl, weight_offset: float) -> None:
    _validate_rms(input, weight, eps, None, enable_pdl, residual=residual)
    if torch.compiler.is_compiling():
        torch.ops.fi_sampling.fused_add_rmsnorm(input, residual, weight, float(eps), weight_offset)
    else:
        _fused_dispatch(_OPS_BY_OFFSET[weight_offset][1], input, residual, weight, float(eps),
                        weight_offset)


# ---- public API ----------------------------------------------------------------------------------

def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
            out: Optional[torch.Tensor] = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """Root mean square normalization: ``out = input * rsqrt(mean(input^2) + eps) * weight``.

    Parameters
    ----------
    input : torch.Tensor
        ``[tokens, hidden]``, or ``[tokens, heads, head_dim]`` to normalise each head (QK-norm),
        float16 or bfloat16 (float32 runs the reference). The last dimension must be contiguous;
        rows may be strided (e.g. q sliced out of a fused qkv tensor).
    weight : torch.Tensor
        ``[hidden]`` (or ``[head_dim]``), contiguous, same dtype as ``input``.
    eps : float
        Added to the mean square before the reciprocal square root.
    out : torch.Tensor, optional
        Output with the shape and dtype of ``input`` (may be ``input`` itself); allocated if None.
    enable_pdl : bool, optional
        Accepted for FlashInfer compatibility; ignored (no programmatic dependent launch).

    Returns
    -------
    torch.Tensor
        ``out``. Math is fp32 with one rounding to the input dtype.

    Examples
    --------
    >>> import torch
    >>> from fi_sampling.norm import rmsnorm
    >>> x = torch.randn(4, 64, dtype=torch.bfloat16)
    >>> rmsnorm(x, torch.ones(64, dtype=torch.bfloat16)).shape
    torch.Size([4, 64])

    See Also
    --------
    fused_add_rmsnorm, gemma_rmsnorm
    """
    return _rms_public(input, weight, eps, out, enable_pdl, 0.0)


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                  out: Optional[torch.Tensor] = None,
                  enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """Gemma-style RMSNorm: ``out = input * rsqrt(mean(input^2) + eps) * (1 + weight)``.

    Shapes, dtypes and parameters as :func:`rmsnorm`.

    Examples
    --------
    >>> import torch
    >>> from fi_sampling.norm import gemma_rmsnorm
    >>> x = torch.randn(2, 32, dtype=torch.float16)
    >>> gemma_rmsnorm(x, torch.zeros(32, dtype=torch.float16)).dtype
    torch.float16

    See Also
    --------
    rmsnorm, gemma_fused_add_rmsnorm
    """
    return _rms_public(input, weight, eps, out, enable_pdl, 1.0)


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float = 1e-6, enable_pdl: Optional[bool] = None) -> None:
    """Fused residual add and RMSNorm, in place.

    ``residual = round(input + residual)``; ``input = rmsnorm(residual, weight, eps)``. The sum
    is rounded to the dtype before it is normalised (as FlashInfer stores it).

    Parameters
    ----------
    input : torch.Tensor
        ``[tokens, hidden]`` (or ``[tokens, heads, head_dim]``), float16/bfloat16; overwritten
        with the normalised output. Last dimension contiguous, rows may be strided.
    residual : torch.Tensor
        Same shape and dtype as ``input``; overwritten with ``input + residual``.
    weight : torch.Tensor
        ``[hidden]``, contiguous, same dtype as ``input``.
    eps : float
        Added to the mean square.
    enable_pdl : bool, optional
        Accepted and ignored.

    Examples
    --------
    >>> import torch
    >>> from fi_sampling.norm import fused_add_rmsnorm
    >>> x, r = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(3, 16, dtype=torch.bfloat16)
    >>> fused_add_rmsnorm(x, r, torch.ones(16, dtype=torch.bfloat16))

    See Also
    --------
    rmsnorm, gemma_fused_add_rmsnorm
    """
    _fused_public(input, residual, weight, eps, enable_pdl, 0.0)


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float = 1e-6, enable_pdl: Optional[bool] = None) -> None:
    """Gemma-style fused add + RMSNorm, in place: as :func:`fused_add_rmsnorm` with ``(1 + weight)``.

    Examples
    --------
    >>> import torch
    >>> from fi_sampling.norm import gemma_fused_add_rmsnorm
    >>> x, r = torch.randn(3, 16, dtype=torch.float16), torch.randn(3, 16, dtype=torch.float16)
    >>> gemma_fused_add_rmsnorm(x, r, torch.zeros(16, dtype=torch.float16))

    See Also
    --------
    fused_add_rmsnorm, gemma_rmsnorm
    """
    _fused_public(input, residual, weight, eps, enable_pdl, 1.0)


def layernorm(input: torch.Tensor, gemma: torch.Tensor, beta: torch.Tensor,
              eps: float = 1e-6) -> torch.Tensor:
    """Layer normalization: ``(input - mean) / sqrt(var + eps) * gemma + beta`` over the last dim.

    Parameters
    ----------
    input : torch.Tensor
        ``[batch, hidden]``, bfloat16 or float16 (FlashInfer documents bfloat16); last dimension
        contiguous, rows may be strided.
    gemma : torch.Tensor
        ``[hidden]`` float32 gain (FlashInfer's name for gamma), contiguous.
    beta : torch.Tensor
        ``[hidden]`` float32 bias, contiguous.
    eps : float
        Added to the (biased) variance.

    Returns
    -------
    torch.Tensor
        ``[batch, hidden]``, dtype of ``input``.

    Examples
    --------
    >>> import torch
    >>> from fi_sampling.norm import layernorm
    >>> x = torch.randn(2, 8, dtype=torch.bfloat16)
    >>> layernorm(x, torch.ones(8), torch.zeros(8)).shape
    torch.Size([2, 8])

    See Also
    --------
    rmsnorm
    """
    _check_rows("input", input, ndims=(2,))
    _check_vector("gemma", gemma, input.shape[-1], (torch.float32,))
    _check_vector("beta", beta, input.shape[-1], (torch.float32,))
    checks.same_device(input=input, gemma=gemma, beta=beta)
    _check_eps(eps)
    out = torch.empty_like(input)
    if torch.compiler.is_compiling():
        torch.ops.fi_sampling.layernorm(out, input, gemma, beta, float(eps))
    else:
        _ln_dispatch(out, input, gemma, beta, float(eps))
    return out
