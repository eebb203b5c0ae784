"""The scalar options decode and prefill share (sm_scale, logits_soft_cap, rope_scale and
rope_theta), checked once and turned into the floats the kernels take."""

from __future__ import annotations

import math
from typing import Optional

from fi_core import checks
from fi_core.errors import InputError


def softmax_scale(sm_scale: Optional[float], head_dim: int) -> float:
    """``sm_scale``, or 1 / sqrt(head_dim) when None."""
    return checks.float_option("sm_scale", sm_scale, 1.0 / math.sqrt(head_dim))


def soft_cap(logits_soft_cap: Optional[float]) -> float:
    """The soft cap, 0.0 when off (None or 0)."""
    cap = checks.float_option("logits_soft_cap", logits_soft_cap, 0.0)
    if cap < 0:
        raise InputError(f"logits_soft_cap must be None, 0 (off) or > 0, got {logits_soft_cap}")
    return cap


def rope_options(rope_scale: Optional[float], rope_theta: Optional[float]) -> tuple[float, float]:
    """(rope_scale, rope_theta), 1.0 and 1e4 when None."""
    return (checks.float_option("rope_scale", rope_scale, 1.0, positive=True),
            checks.float_option("rope_theta", rope_theta, 1e4, positive=True))


def check_forward_options(planned: dict, head_dim: int, **given) -> None:
    """The legacy ``forward()`` takes the attention options FlashInfer's did, but here they are
    fixed by ``plan()`` (``begin_forward``). Each option given (not None) must equal the planned
    one: ignoring a different value would silently compute something else. ``planned`` maps each
    name to plan()'s value in the form the kernels take (scales as floats, the soft cap 0.0 off)."""
    norm = {"sm_scale": lambda v: softmax_scale(v, head_dim), "logits_soft_cap": soft_cap,
            "rope_scale": lambda v: rope_options(v, None)[0], "rope_theta": lambda v: rope_options(None, v)[1],
            "causal": bool}
    for name, value in given.items():
        if value is None:
            continue
        want = planned[name]
        got = norm.get(name, lambda v: v)(value)
        if got != want:
            raise InputError(f"forward(): {name}={value!r} differs from the planned {want!r}; the attention "
                             f"options are fixed by plan() (begin_forward): plan again with {name}={value!r}")
