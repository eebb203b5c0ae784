"""Gated activations: FlashInfer's ``flashinfer.activation`` (silu_and_mul, gelu_and_mul,
gelu_tanh_and_mul): ``out = act(input[..., :d]) * input[..., d:]``.

Path of a call: validate -> choose a backend (cached per device and dtype) -> the CUDA launcher
in ``act_and_mul.cu`` or the fp32 reference. Under ``torch.compile`` the call goes through the
custom op ``fi_sampling::act_and_mul`` (fake impl registered).

``enable_pdl`` is accepted for FlashInfer compatibility and ignored (plain stream-ordered
launches, no programmatic dependent launch).
"""

from __future__ import annotations

from typing import Optional

import torch

from fi_core import Backend, OpInfo, arch_of, checks, current_stream, load, on_device, register_op
from fi_core.errors import InputError, InputTypeError

from .reference import act_and_mul_reference
from .spec import ACT_CODES, act_and_mul_spec

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _op(name: str, act: str) -> OpInfo:
    return register_op(OpInfo(
        name=name, family="fi-sampling", api=f"flashinfer.activation.{name}",
        doc=f"{act}(x[..., :d]) * x[..., d:]",
        backends=(
            Backend("cuda", min_arch="8.0", dtypes=_HALF, notes="streaming, 16-byte accesses"),
            Backend("reference", devices=("cpu", "cuda"), notes="pure torch, fp32 math"),
        ),
        specs=lambda arch: [act_and_mul_spec(torch.bfloat16, arch),
                            act_and_mul_spec(torch.float16, arch)],
    ))


OPS = {
    "silu": _op("silu_and_mul", "silu"),
    "gelu": _op("gelu_and_mul", "gelu"),
    "gelu_tanh": _op("gelu_tanh_and_mul", "gelu_tanh"),
}
_CHOICE: dict = {}


def _rows_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """[rows, last] view sharing storage; leading dims must collapse to one row stride."""
    if t.dim() == 1:
        return t.unsqueeze(0)
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise InputError(f"{name}'s leading dimensions must collapse to one row stride (a view "
                         f"[-1, {t.shape[-1]}]), got shape {tuple(t.shape)} strides {t.stride()}; "
                         f"call .contiguous() first") from None


def _validate(input, out, enable_pdl) -> None:
    checks.tensor("input", input)
    checks.dtype("input", input, _FLOATS)
    if input.dim() < 1:
        raise InputError(f"input must have at least 1 dimension, got shape {tuple(input.shape)}")
    if input.shape[-1] % 2:
        raise InputError(f"input's last dimension must be even (2 * d), got {input.shape[-1]}")
    checks.last_dim_contiguous("input", input)
    if out is not None:
        checks.tensor("out", out)
        if out.dtype != input.dtype:
            raise InputTypeError(f"out must have the dtype of input ({input.dtype}), got {out.dtype}")
        want = (*input.shape[:-1], input.shape[-1] // 2)
        checks.shape("out", out, want, "input's shape with the last dimension halved")
        checks.last_dim_contiguous("out", out)
        checks.same_device(input=input, out=out)
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise InputTypeError(f"enable_pdl must be None or a bool, got {type(enable_pdl).__name__}")


def _dispatch(out: torch.Tensor, input: torch.Tensor, act: str) -> None:
    op = OPS[act]
    key = (act, input.device, input.dtype)
    backend = _CHOICE.get(key)
    if backend is None:
        backend = _CHOICE[key] = op.choose(device=input.device, dtype=input.dtype).name
    if input.device.type == "cuda" and backend == "cuda":
        if input.numel() == 0:
            return
        x2, o2 = _rows_view("input", input), _rows_view("out", out)
        d = o2.shape[1]
        mod = load(act_and_mul_spec(input.dtype, arch_of(input.device)))
        with on_device(input.device):
            mod.fi_act_and_mul(o2.data_ptr(), x2.data_ptr(), x2.shape[0], d, o2.stride(0),
                               x2.stride(0), ACT_CODES[act], current_stream(input.device))
    else:
        out.copy_(act_and_mul_reference(input, act))


@torch.library.custom_op("fi_sampling::act_and_mul", mutates_args=("out",))
def _act_and_mul_op(out: torch.Tensor, input: torch.Tensor, act: str) -> None:
    _dispatch(out, input, act)


@_act_and_mul_op.register_fake
def _(out, input, act) -> None:
    return None


def _public(input, out, enable_pdl, act: str) -> torch.Tensor:
    _validate(input, out, enable_pdl)
    if out is None:
        out = torch.empty((*input.shape[:-1], input.shape[-1] // 2), dtype=input.dtype,
                          device=input.device)
    if input.device.type == "cuda" and not torch.compiler.is_compiling():
        # Checked here, not in the custom op: a non-collapsible view must fail before launch.
        _rows_view("input", input)
        _rows_view("out", out)
    if torch.compiler.is_compiling():
        torch.ops.fi_sampling.act_and_mul(out, input, act)
    else:
        _dispatch(out, input, act)
    return out


_DOC = """{title}: ``out = {act}(input[..., :d]) * input[..., d:]``.

    Parameters
    ----------
    input : torch.Tensor
        ``[..., 2 * d]``, float16 or bfloat16 (float32 runs the reference), any leading shape
        whose dimensions collapse to one row stride (e.g. a contiguous tensor or a 2-D slice with
        strided rows); last dimension contiguous.
    out : torch.Tensor, optional
        ``[..., d]``, same dtype; must not overlap ``input``. Allocated if None.
    enable_pdl : bool, optional
        Accepted for FlashInfer compatibility; ignored.

    Returns
    -------
    torch.Tensor
        ``out``; fp32 math, one rounding to the input dtype.

    Examples
    --------
    >>> import torch
    >>> from fi_sampling.activation import {name}
    >>> {name}(torch.randn(4, 2 * 16, dtype=torch.bfloat16)).shape
    torch.Size([4, 16])

    See Also
    --------
    silu_and_mul, gelu_and_mul, gelu_tanh_and_mul
    """


def silu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None,
                 enable_pdl: Optional[bool] = None) -> torch.Tensor:
    return _public(input, out, enable_pdl, "silu")


def gelu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None,
                 enable_pdl: Optional[bool] = None) -> torch.Tensor:
    return _public(input, out, enable_pdl, "gelu")


def gelu_tanh_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None,
                      enable_pdl: Optional[bool] = None) -> torch.Tensor:
    return _public(input, out, enable_pdl, "gelu_tanh")


silu_and_mul.__doc__ = _DOC.format(title="SiLU-gated product (SwiGLU)", act="silu",
                                   name="silu_and_mul")
gelu_and_mul.__doc__ = _DOC.format(title="GELU-gated product (GeGLU, exact erf GELU)", act="gelu",
                                   name="gelu_and_mul")
gelu_tanh_and_mul.__doc__ = _DOC.format(title="GELU-gated product, tanh approximation",
                                        act="gelu_tanh", name="gelu_tanh_and_mul")
