"""Sampling benchmark routines (shared/TARGETS.md): vocab 128256, float32, batch 1 / 64 / 256.

`flashinfer bench --routine top_p_sampling_from_probs` (and top_k_sampling_from_probs,
min_p_sampling_from_probs, top_k_top_p_sampling_from_logits). Each first checks that our tokens
lie in the exact filtered set (float64 reference), then times ours and the torch sort-based
sampler (sort, cumsum, mask, torch.multinomial) on the same L2-rotated inputs. Bytes = the
probabilities (or logits) read once; the kernels make a few passes, so TB/s is a lower bound.
"""

from __future__ import annotations

import torch

from fi_core.bench import BenchRow, RoutineArgs, rotating_inputs, routine, time_fn

from .sampling import (
    min_p_sampling_from_probs, top_k_sampling_from_probs, top_k_top_p_sampling_from_logits,
    top_p_sampling_from_probs,
)
from .sampling import reference as R

VOCAB = 128256
BATCHES = (1, 64, 256)
TARGETS = {  # us at batch 1 / 64 / 256
    "top_p_sampling_from_probs": (36, 79, 126),
    "top_k_sampling_from_probs": (60, 150, 250),
    "min_p_sampling_from_probs": (46, 53, 116),
    "top_k_top_p_sampling_from_logits": (100, 180, 400),
}


def _logits(i: int, batch: int, dev) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(1000 + i)
    return torch.randn(batch, VOCAB, device=dev, generator=g)


def _torch_top_p(probs, p):
    s, idx = probs.sort(dim=-1, descending=True)
    above = s.cumsum(dim=-1) - s
    s = s.masked_fill(above >= p, 0.0)
    return idx.gather(1, torch.multinomial(s, 1)).squeeze(1)


def _torch_top_k(probs, k):
    s, idx = probs.sort(dim=-1, descending=True)
    s = s[:, :k]
    return idx.gather(1, torch.multinomial(s, 1)).squeeze(1)


def _torch_min_p(probs, p):
    s, idx = probs.sort(dim=-1, descending=True)
    s = s.masked_fill(s < p * s[:, :1], 0.0)
    return idx.gather(1, torch.multinomial(s, 1)).squeeze(1)


def _torch_top_k_top_p_logits(logits, k, p):
    probs = torch.softmax(logits, dim=-1)
    s, idx = probs.sort(dim=-1, descending=True)
    s = s[:, :k]
    s = s / s.sum(dim=-1, keepdim=True)
    above = s.cumsum(dim=-1) - s
    s = s.masked_fill(above >= p, 0.0)
    return idx.gather(1, torch.multinomial(s, 1)).squeeze(1)


def _check(name: str, toks: torch.Tensor, keep: torch.Tensor) -> None:
    t = toks.long().cpu()
    if not keep[torch.arange(t.numel()), t].all():
        raise AssertionError(f"{name}: a token outside the filtered set was returned")


def _run(name: str, args: RoutineArgs, ours, base, keep_fn, logits_input: bool, param: str):
    dev = torch.device(args.device)
    batches = BATCHES[:1] if args.quick else BATCHES
    for batch in batches:
        make = (lambda i, batch=batch: (_logits(i, batch, dev),)) if logits_input else \
            (lambda i, batch=batch: (torch.softmax(_logits(i, batch, dev), dim=-1),))
        sets = rotating_inputs(make, dev)
        x = sets[0][0]
        _check(name, ours(x), keep_fn(x))
        t_ours = time_fn(ours, sets)
        t_base = time_fn(base, sets)
        yield BenchRow(name, f"batch {batch}, vocab {VOCAB}, {param}", t_ours,
                       bytes=batch * VOCAB * 4, baseline=("torch sort+multinomial", t_base),
                       target_us=TARGETS[name][BATCHES.index(batch)], backend="cuda")


@routine("top_p_sampling_from_probs", family="fi-sampling",
         help="top-p 0.9 sampling, softmax(N(0,1)) probs, vs torch sort + multinomial")
def bench_top_p(args: RoutineArgs):
    yield from _run("top_p_sampling_from_probs", args,
                    lambda p: top_p_sampling_from_probs(p, 0.9, seed=0, offset=0),
                    lambda p: _torch_top_p(p, 0.9),
                    lambda p: R.top_p_mask(p, 0.9 + 1e-5), False, "p=0.9")


@routine("top_k_sampling_from_probs", family="fi-sampling",
         help="top-k 50 sampling, softmax(N(0,1)) probs, vs torch sort + multinomial")
def bench_top_k(args: RoutineArgs):
    yield from _run("top_k_sampling_from_probs", args,
                    lambda p: top_k_sampling_from_probs(p, 50, seed=0, offset=0),
                    lambda p: _torch_top_k(p, 50),
                    lambda p: R.top_k_mask(p, 50), False, "k=50")


@routine("min_p_sampling_from_probs", family="fi-sampling",
         help="min-p 0.1 sampling, softmax(N(0,1)) probs, vs torch sort + multinomial")
def bench_min_p(args: RoutineArgs):
    yield from _run("min_p_sampling_from_probs", args,
                    lambda p: min_p_sampling_from_probs(p, 0.1, seed=0, offset=0),
                    lambda p: _torch_min_p(p, 0.1),
                    lambda p: R.min_p_mask(p, 0.1 * (1 - 1e-6)), False, "min_p=0.1")


@routine("top_k_top_p_sampling_from_logits", family="fi-sampling",
         help="top-k 50 then top-p 0.9 from N(0,1) logits, vs torch softmax + sort + multinomial")
def bench_top_k_top_p_logits(args: RoutineArgs):
    def keep(x):
        p = torch.softmax(x.double(), dim=-1)
        return R.filtered_probs(p, "top_k_top_p", top_k=50, top_p=0.9 + 1e-5) > 0

    yield from _run("top_k_top_p_sampling_from_logits", args,
                    lambda x: top_k_top_p_sampling_from_logits(x, 50, 0.9, seed=0, offset=0),
                    lambda x: _torch_top_k_top_p_logits(x, 50, 0.9),
                    keep, True, "k=50 p=0.9")
