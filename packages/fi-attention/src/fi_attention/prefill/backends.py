"""Prefill backends and the dispatch seam shared by single prefill and the batch wrappers.

``fa2``: the portable tensor-core kernel of this folder (sm_80+). ``fa3``: the Hopper kernel of
``fi_attention.prefill.hopper`` (sm_90a), reached through its ``run(call)``. ``reference``: the
fp32 torch reference (CPU tensors). ``backend="auto"`` takes fa3 when its module can run the case,
else fa2; ``FI_LOG_DISPATCH=1`` logs the choice and every skipped backend's reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from fi_core import Backend, OpInfo, register_op

from .launch import PrefillCall, run_fa2
from .spec import fa2_spec

HALF_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# (head_dim_qk, head_dim_vo) pairs the fa2 kernel is built for.
FA2_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))


def fa2_unsupported(facts: dict) -> Optional[str]:
    dims = (facts.get("head_dim_qk"), facts.get("head_dim_vo"))
    if None not in dims and dims not in FA2_HEAD_DIMS:
        return f"head dims (qk, vo) must be one of {FA2_HEAD_DIMS}, got {dims}"
    kv = facts.get("kv_dtype")
    if kv is not None and facts.get("dtype") is not None and kv not in (facts["dtype"],) + FP8_DTYPES:
        return f"needs k/v dtype == q dtype ({facts['dtype']}) or float8_e4m3fn/e5m2, got {kv}"
    return None


def _hopper():
    try:
        from . import hopper  # noqa: PLC0415
    except Exception as exc:  # a broken optional module must not break fa2
        return None, f"fi_attention.prefill.hopper is not importable ({exc})"
    if not callable(getattr(hopper, "run", None)):
        return None, "fi_attention.prefill.hopper has no run(call) entry yet"
    return hopper, None


def fa3_unsupported(facts: dict) -> Optional[str]:
    mod, why = _hopper()
    if mod is None:
        return why
    check = getattr(mod, "unsupported_reason", None)
    return check(facts) if callable(check) else None


def run_fa3(call: PrefillCall) -> None:
    mod, why = _hopper()
    if mod is None:
        raise RuntimeError(why)
    mod.run(call)


RUNNERS: dict[str, Callable[[PrefillCall], None]] = {"fa2": run_fa2, "fa3": run_fa3}

BACKENDS = (
    Backend("fa3", archs=("9.0a",), dtypes=HALF_DTYPES, check=fa3_unsupported,
            notes="Hopper wgmma/TMA kernel (fi_attention.prefill.hopper)"),
    Backend("fa2", min_arch="8.0", dtypes=HALF_DTYPES, check=fa2_unsupported,
            notes="portable mma.sync kernel; d 64/128/256, 192x128"),
    Backend("reference", devices=("cpu",), notes="pure torch, fp32 math"),
)


def _specs(arch):
    """Representative modules for precompile and the compile check: fa2 ragged, paged and paged
    with an fp8 e4m3 cache, and on sm_90a the fa3 ragged and paged causal d128 kernels, with K/V
    multicast (even GQA groups) and without, the paged one over an fp8 e4m3 cache, its ragged
    d128 custom-mask kernels without and with a soft cap (so the compile check holds them to
    their spill budgets), and the paged causal d256 kernel (its own tile shape, producer and
    register budget: a shared helper that only held at d <= 128 once kept every d256 module
    from compiling, unseen by a check that built d128 only)."""
    specs = [fa2_spec(torch.bfloat16, 128, 128, False, arch),
             fa2_spec(torch.bfloat16, 128, 128, True, arch),
             fa2_spec(torch.bfloat16, 128, 128, True, arch, kv_dtype=torch.float8_e4m3fn)]
    if arch.cc == 90 and arch.suffix == "a":
        from .hopper.spec import prefill_sm90_spec  # noqa: PLC0415

        specs += [prefill_sm90_spec(torch.bfloat16, 128, True, arch, paged=paged, multicast=mc)
                  for paged in (False, True) for mc in (True, False)]
        specs += [prefill_sm90_spec(torch.bfloat16, 128, False, arch, custom_mask=True, softcap=cap)
                  for cap in (False, True)]
        specs += [prefill_sm90_spec(torch.bfloat16, 128, True, arch, paged=True, kv_dtype=torch.float8_e4m3fn)]
        specs += [prefill_sm90_spec(torch.bfloat16, 256, True, arch, paged=True)]
    return specs


SINGLE_PREFILL = register_op(OpInfo(
    name="single_prefill_with_kv_cache", family="fi-attention",
    api="flashinfer.prefill.single_prefill_with_kv_cache", backends=BACKENDS, specs=_specs))
RAGGED_PREFILL = register_op(OpInfo(
    name="BatchPrefillWithRaggedKVCacheWrapper", family="fi-attention",
    api="flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper", backends=BACKENDS, specs=_specs))
PAGED_PREFILL = register_op(OpInfo(
    name="BatchPrefillWithPagedKVCacheWrapper", family="fi-attention",
    api="flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper", backends=BACKENDS, specs=_specs))
