"""Argument validation and RNG plumbing shared by the sampling ops.

Every check runs before any launch and says what was expected and what was found. Nothing here
synchronises with the GPU except ``check_nan=True`` (documented on every public op).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from fi_core import checks
from fi_core.errors import InputError, InputTypeError

MASK63 = (1 << 63) - 1
# Counter offsets used per call when drawing from a torch generator (Philox draws are 4-wide).
GENERATOR_INCREMENT = 4


def matrix(name: str, t, dtypes=(torch.float32,)) -> torch.Tensor:
    checks.tensor(name, t)
    checks.dtype(name, t, dtypes)
    checks.ndim(name, t, (2,))
    checks.last_dim_contiguous(name, t)
    if t.shape[1] == 0:
        raise InputError(f"{name} must have a non-empty last dimension, got shape {tuple(t.shape)}")
    return t


def indices_arg(indices, probs: torch.Tensor) -> Optional[torch.Tensor]:
    if indices is None:
        return None
    checks.tensor("indices", indices)
    checks.dtype("indices", indices, (torch.int32, torch.int64))
    checks.ndim("indices", indices, (1,))
    if indices.device != probs.device:
        raise InputError(f"indices must be on {probs.device} like the probabilities, got {indices.device}")
    from fi_core import knobs  # noqa: PLC0415

    if knobs.check_inputs() and indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= probs.shape[0]:
            raise InputError(f"indices must lie in [0, {probs.shape[0]}), got range [{lo}, {hi}]")
    return indices.to(torch.int32).contiguous()


def out_rows(probs: torch.Tensor, indices: Optional[torch.Tensor]) -> int:
    return probs.shape[0] if indices is None else indices.shape[0]


def threshold(name: str, value, rows: int, device, *, integer: bool,
              lo: float, hi: float, lo_open: bool) -> tuple[Optional[torch.Tensor], Union[int, float]]:
    """A scalar or per-row threshold -> (tensor or None, scalar). Scalars are range-checked."""
    if isinstance(value, torch.Tensor):
        allowed = (torch.int32, torch.int64) if integer else (torch.float32,)
        checks.dtype(name, value, allowed)
        if value.dim() != 1 or value.shape[0] != rows:
            raise InputError(f"{name} as a tensor must have shape [{rows}] (one value per output "
                             f"row), got {tuple(value.shape)}")
        if value.device != device:
            raise InputError(f"{name} must be on {device}, got {value.device}")
        return value.to(torch.int32 if integer else torch.float32).contiguous(), 0
    if integer:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputTypeError(f"{name} must be an int or an int32/int64 tensor, got {type(value).__name__}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputTypeError(f"{name} must be a float or a float32 tensor, got {type(value).__name__}")
    ok_lo = value > lo if lo_open else value >= lo
    if not (ok_lo and value <= hi):  # written so that NaN fails
        lb = "(" if lo_open else "["
        raise InputError(f"{name} must be in {lb}{lo}, {hi}], got {value!r}")
    return None, value


@dataclass
class Rng:
    seed_arr: Optional[torch.Tensor]
    seed: int
    offset_arr: Optional[torch.Tensor]
    offset: int

    def strides(self) -> tuple[int, int]:
        s = 0 if self.seed_arr is None or self.seed_arr.numel() == 1 else 1
        o = 0 if self.offset_arr is None or self.offset_arr.numel() == 1 else 1
        return s, o


def _rng_value(name: str, v, rows: int, device) -> tuple[Optional[torch.Tensor], int]:
    if v is None:
        return None, 0
    if isinstance(v, torch.Tensor):
        checks.dtype(name, v, (torch.int64,))
        if v.numel() not in (1, rows):
            raise InputError(f"{name} as a tensor must have 1 or {rows} elements, got shape {tuple(v.shape)}")
        if v.device != device:
            raise InputError(f"{name} must be on {device} (read by the kernel at run time), got {v.device}")
        return v.reshape(-1).contiguous(), 0
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputTypeError(f"{name} must be an int or an int64 tensor, got {type(v).__name__}")
    return None, v & MASK63


def from_generator(generator: Optional[torch.Generator], device: torch.device) -> tuple[int, int]:
    """Take (seed, offset) from a torch generator on the host and advance it, as FlashInfer does.
    A CUDA generator's state is (seed, philox offset): no device work, no synchronisation."""
    if generator is None:
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            generator = torch.cuda.default_generators[idx]
        else:
            generator = torch.default_generator
    if generator.device.type == "cuda":
        state = generator.get_state()
        if state.numel() == 16:
            seed, off = state.view(torch.int64).tolist()
            new = torch.tensor([seed, off + GENERATOR_INCREMENT], dtype=torch.int64)
            generator.set_state(new.view(torch.uint8))
            return seed & MASK63, off & MASK63
    draw = torch.randint(0, 1 << 62, (2,), generator=generator, device=generator.device)
    seed, off = draw.tolist()
    return seed, off


def rng_args(generator, seed, offset, rows: int, device: torch.device) -> Rng:
    if seed is None and offset is None:
        s, o = from_generator(generator, device)
        return Rng(None, s, None, o)
    sa, s = _rng_value("seed", seed, rows, device)
    oa, o = _rng_value("offset", offset, rows, device)
    return Rng(sa, s, oa, o)


def check_no_nan(name: str, t: torch.Tensor) -> None:
    """check_nan=True: one device-wide reduction and a host read (synchronises)."""
    if bool(torch.isnan(t).any()):
        raise InputError(f"{name} contains NaN")
