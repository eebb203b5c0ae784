"""The op families and the packages that provide them.

fi-core imports a family only when asked (CLI, support matrix, precompile), never at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass

log = logging.getLogger("fi")


@dataclass(frozen=True)
class Family:
    dist: str      # pip name
    module: str    # import name
    summary: str


FAMILIES = (
    Family("fi-attention", "fi_attention", "decode, prefill, paged KV, cascade/merge"),
    Family("fi-gemm", "fi_gemm", "bf16/fp16/fp8 GEMM, grouped and segment GEMM"),
    Family("fi-moe", "fi_moe", "MoE routing, permute, fused MoE"),
    Family("fi-sampling", "fi_sampling", "sampling, RoPE, norms, gated activations"),
    Family("fi-comm", "fi_comm", "custom all-reduce and collectives"),
)


def installed(family: Family) -> bool:
    return importlib.util.find_spec(family.module) is not None


def _try_import(name: str) -> bool:
    """Import a family module for a CLI listing. A family that fails to import is reported (with
    the error) and skipped, so one broken install does not hide every other family."""
    try:
        importlib.import_module(name)
        return True
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        log.warning("fi: could not import %s (%s: %s); its ops are left out", name,
                    type(exc).__name__, exc)
        return False


def import_all() -> list[str]:
    """Import every installed family (which registers its ops); returns the imported names."""
    return [f.module for f in FAMILIES if installed(f) and _try_import(f.module)]


def import_bench_routines() -> list[str]:
    """Import `<family>.bench` modules (they register benchmark routines)."""
    return [f.module for f in FAMILIES
            if installed(f) and importlib.util.find_spec(f"{f.module}.bench") is not None
            and _try_import(f"{f.module}.bench")]
