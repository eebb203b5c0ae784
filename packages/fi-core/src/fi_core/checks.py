"""Input validation helpers: every message says what was expected and what was found."""

from __future__ import annotations

import math
import operator
from typing import Optional
from collections.abc import Iterable, Sequence

import torch

from .dtypes import parse as parse_dtype
from .errors import InputError, InputTypeError


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def int32_vector(name: str, t) -> torch.Tensor:
    """A 1-D int32 tensor (index tables: indptr, indices, lengths), any device."""
    tensor(name, t)
    if t.dtype != torch.int32:
        raise InputTypeError(f"{name} must be int32, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != 1:
        raise InputError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t


def dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    tensor(name, t)
    if t.dtype not in allowed:
        raise InputTypeError(f"{name} must be {_names(allowed)}, got {str(t.dtype).replace('torch.', '')}")


def ndim(name: str, t: torch.Tensor, allowed: Iterable[int]) -> None:
    allowed = tuple(allowed)
    if t.dim() not in allowed:
        want = " or ".join(f"{n}-D" for n in allowed)
        raise InputError(f"{name} must be {want}, got shape {tuple(t.shape)}")


def shape(name: str, t: torch.Tensor, expected: Sequence[Optional[int]], what: str = "") -> None:
    _check_shape(name, t, expected, what)


def _check_shape(name: str, t: torch.Tensor, expected: Sequence[Optional[int]], what: str = "") -> None:
    """expected: sizes, None = any."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise InputError(f"{name} must have shape {want}{' (' + what + ')' if what else ''}, "
                         f"got {tuple(t.shape)}")


def same_device(**tensors: Optional[torch.Tensor]) -> Optional[torch.device]:
    """The one device of the named tensors (None entries skipped; None if all are). A non-tensor
    raises InputTypeError; tensors on different devices raise InputError naming each one's
    device. One comparison per tensor (~0.2 us each): cheap enough for every op's checked path."""
    dev = None
    for name, t in tensors.items():
        if t is not None:
            d = tensor(name, t).device
            if dev is None:
                dev = d
            elif d != dev:
                detail = ", ".join(f"{k} on {v.device}" for k, v in tensors.items() if v is not None)
                raise InputError(f"all tensors must be on one device, got {detail}")
    return dev


def last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise InputError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise InputError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def workspace(t, device: Optional[torch.device] = None) -> int:
    """A float workspace buffer (any dtype: it is used as bytes): a contiguous tensor, on
    ``device`` when given (a wrapper's buffer replaced by reset_workspace_buffer). Its bytes."""
    tensor("float_workspace_buffer", t)
    contiguous("float_workspace_buffer", t)
    if device is not None and t.device != device:
        raise InputError(f"float_workspace_buffer must stay on the wrapper's device {device}, got {t.device}")
    return t.numel() * t.element_size()


def aligned(name: str, t: torch.Tensor, bytes_: int) -> bool:
    return t.data_ptr() % bytes_ == 0


def positive(name: str, value, allow_zero: bool = False) -> None:
    if value is None or (value < 0 if allow_zero else value <= 0):
        raise InputError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def indptr_values(name: str, t: torch.Tensor, end: Optional[int] = None, exact: bool = False,
                  end_name: str = "") -> None:
    """The values of a CSR indptr: it starts at 0, never decreases and ends at ``end`` (``exact``)
    or at most there (``end_name`` says what ``end`` is, e.g. "nnz"). Reads the values, so on a
    GPU tensor it synchronises: callers run it on host tensors, or on device ones with
    FI_CHECK_INPUTS=1."""
    ind = t.to("cpu", torch.int64)
    bad = ind.numel() == 0 or int(ind[0]) != 0 or bool((ind[1:] < ind[:-1]).any())
    if end is not None and not bad:
        bad = int(ind[-1]) != end if exact else int(ind[-1]) > end
    if bad:
        bound = f"{end_name}={end}" if end_name else str(end)
        tail = "" if end is None else f" and end {'at' if exact else '<='} {bound}"
        raise InputError(f"{name} must start at 0{',' if tail else ' and'} be non-decreasing{tail}, got "
                         f"{ind.tolist()[:8]}{'...' if ind.numel() > 8 else ''}")


def index_values(name: str, t: torch.Tensor, high: int, what: str = "") -> None:
    """Every value of an index tensor lies in [0, ``high``) (``what`` says what ``high`` counts,
    e.g. " (the cache's page count)"). Reads the values, so on a GPU tensor it synchronises:
    callers run it on host tensors, or on device ones with FI_CHECK_INPUTS=1."""
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= high:
            raise InputError(f"{name} must be in [0, {high}){what}, got [{lo}, {hi}]")


def dtype_value(name: str, value, allowed: Sequence[torch.dtype]) -> torch.dtype:
    """A dtype argument (a torch.dtype or its name, e.g. ``"bf16"``) that must be one of ``allowed``."""
    try:
        dt = parse_dtype(value)
    except TypeError:
        raise InputTypeError(f"{name} must be a torch.dtype or its name, got {value!r}") from None
    if dt not in allowed:
        raise InputTypeError(f"{name} must be {_names(allowed)}, got {_names((dt,))}")
    return dt


def int_value(name: str, value, low: int) -> int:
    """``value`` as a Python int >= ``low`` (Python, numpy or 0-d integer tensor values; not bools
    or floats)."""
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if n is None or isinstance(value, bool) or n < low:
        raise InputError(f"{name} must be an int >= {low}, got {value!r}")
    return n


def finite_float(name: str, value) -> float:
    """A scale or other real parameter as a finite Python float (ints and numpy / torch scalars
    convert; strings, bools, None, inf and NaN are refused)."""
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise InputTypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise InputTypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not math.isfinite(f):
        raise InputError(f"{name} must be finite, got {f}")
    return f


def float_option(name: str, value, default: float, positive: bool = False) -> float:
    """An optional real parameter: ``default`` for None, else a finite float (> 0 if ``positive``)."""
    if value is None:
        return default
    f = finite_float(name, value)
    if positive and f <= 0:
        raise InputError(f"{name} must be > 0, got {f}")
    return f


def output(name: str, out: Optional[torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """The destination of an op: a new tensor when `out` is None, else `out` after checking its
    type, shape, dtype, device and last-dimension contiguity (a wrong device would otherwise be an
    illegal memory access inside the kernel)."""
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    tensor(name, out)
    _check_shape(name, out, tuple(shape))
    if out.dtype != dtype:
        raise InputTypeError(f"{name} must be {_names((dtype,))}, got {_names((out.dtype,))}")
    if out.device != torch.device(device):
        raise InputError(f"{name} must be on {device}, got {out.device}")
    last_dim_contiguous(name, out)
    return out
