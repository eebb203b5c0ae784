"""Kernel specs of the sampling ops: one module for sampling, one for thresholds and softmax."""

from __future__ import annotations

import functools
from pathlib import Path

from fi_core import Arch, Entry, KernelSpec

_HERE = Path(__file__).resolve().parent

SAMPLING_ARGS = ("ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i32", "ptr", "i32", "ptr",
                 "f32", "ptr", "u64", "i64", "ptr", "u64", "i64", "stream")
THRESHOLD_ARGS = ("ptr", "ptr", "i64", "i64", "i64", "i64", "i32", "ptr", "i32", "ptr", "f32",
                  "stream")
SOFTMAX_ARGS = ("ptr", "ptr", "i64", "i64", "i64", "i64", "ptr", "f32", "stream")


@functools.cache
def sampling_spec(arch: Arch) -> KernelSpec:
    """fi_sampling_filtered: plain / top-k / top-p / min-p / joint sampling from float32 probs."""
    return KernelSpec(
        name="sampling_filtered",
        sources=(_HERE / "sampling.cu",),
        arch=arch,
        entries=(Entry("fi_sampling_filtered", SAMPLING_ARGS),),
        package="fi_sampling",
    )


@functools.cache
def threshold_spec(arch: Arch) -> KernelSpec:
    """fi_sampling_threshold (renorm / mask) and fi_sampling_softmax on float32 rows."""
    return KernelSpec(
        name="sampling_threshold",
        sources=(_HERE / "renorm.cu",),
        arch=arch,
        entries=(Entry("fi_sampling_threshold", THRESHOLD_ARGS),
                 Entry("fi_sampling_softmax", SOFTMAX_ARGS)),
        package="fi_sampling",
    )


SPECULATIVE_ARGS = ("ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "i64", "i32", "i64", "ptr", "u64",
                    "i64", "ptr", "u64", "i64", "stream")


@functools.cache
def speculative_spec(arch: Arch) -> KernelSpec:
    """fi_chain_speculative_sampling: chain speculative sampling, float32 probabilities."""
    return KernelSpec(
        name="sampling_speculative",
        sources=(_HERE / "speculative.cu",),
        arch=arch,
        entries=(Entry("fi_chain_speculative_sampling", SPECULATIVE_ARGS),),
        package="fi_sampling",
    )


LOGITS_ARGS = ("ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i32", "ptr", "i32", "ptr", "f32",
               "ptr", "u64", "i64", "ptr", "u64", "i64", "stream")


@functools.cache
def logits_spec(arch: Arch) -> KernelSpec:
    """fi_sampling_from_logits: softmax fused into plain / top-k-first / joint sampling."""
    return KernelSpec(
        name="sampling_logits",
        sources=(_HERE / "sampling_logits.cu",),
        arch=arch,
        entries=(Entry("fi_sampling_from_logits", LOGITS_ARGS),),
        package="fi_sampling",
    )
