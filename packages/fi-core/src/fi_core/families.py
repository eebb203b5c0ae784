"""The op families and the packages that provide them.

fi-core imports a family only when asked (CLI, support matrix, precompile), never at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


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


def import_all() -> list[str]:
    """Import every installed family (which registers its ops); returns the imported names."""
    done = []
    for fam in FAMILIES:
        if installed(fam):
            importlib.import_module(fam.module)
            done.append(fam.module)
    return done


def import_bench_routines() -> list[str]:
    """Import `<family>.bench` modules (they register benchmark routines)."""
    done = []
    for fam in FAMILIES:
        if installed(fam) and importlib.util.find_spec(f"{fam.module}.bench") is not None:
            importlib.import_module(f"{fam.module}.bench")
            done.append(fam.module)
    return done
