"""chain_speculative_sampling (FlashInfer-compatible): one CUDA block per request; the float64
reference runs on CPU tensors."""

from __future__ import annotations

from typing import Optional

import torch

from fi_core import arch_of, checks, current_stream, load, on_device
from fi_core.errors import InputError
from fi_core.launch import ptr

from . import _args as A
from . import reference
from ._core import backend_for, make_op
from .spec import speculative_spec

CHAIN_SPECULATIVE = make_op("chain_speculative_sampling")
CHAIN_SPECULATIVE.specs = lambda arch: [speculative_spec(arch)]


def _impl(out: torch.Tensor, acc: torch.Tensor, emi: torch.Tensor, draft_probs: torch.Tensor,
          ids: torch.Tensor, target_probs: torch.Tensor, seed_arr: Optional[torch.Tensor],
          seed: int, off_arr: Optional[torch.Tensor], off: int, backend: str) -> None:
    b, n, v = draft_probs.shape
    if backend == "cuda":
        mod = load(speculative_spec(arch_of(draft_probs.device)))
        ss = 0 if seed_arr is None or seed_arr.numel() == 1 else 1
        os_ = 0 if off_arr is None or off_arr.numel() == 1 else 1
        with on_device(draft_probs.device):
            mod.fi_chain_speculative_sampling(
                out.data_ptr(), acc.data_ptr(), emi.data_ptr(), draft_probs.data_ptr(), ids.data_ptr(),
                target_probs.data_ptr(), b, n, v, ptr(seed_arr), int(seed), ss, ptr(off_arr), int(off),
                os_, current_stream(draft_probs.device))
        return
    s = seed if seed_arr is None else int(seed_arr.reshape(-1)[0])
    o = off if off_arr is None else int(off_arr.reshape(-1)[0])
    r_out, r_acc, r_emi = reference.chain_speculative_sampling(draft_probs, ids, target_probs, s, o)
    out.copy_(r_out.to(out.device))
    acc.add_(r_acc.to(acc.device))
    emi.add_(r_emi.to(emi.device))


@torch.library.custom_op("fi_sampling::chain_speculative_sampling", mutates_args=("out", "acc", "emi"))
def _op(out: torch.Tensor, acc: torch.Tensor, emi: torch.Tensor, draft_probs: torch.Tensor,
        ids: torch.Tensor, target_probs: torch.Tensor, seed_arr: Optional[torch.Tensor], seed: int,
        off_arr: Optional[torch.Tensor], off: int, backend: str) -> None:
    _impl(out, acc, emi, draft_probs, ids, target_probs, seed_arr, seed, off_arr, off, backend)


@_op.register_fake
def _(out, acc, emi, draft_probs, ids, target_probs, seed_arr, seed, off_arr, off, backend) -> None:
    return None


def _counter(name: str, t: Optional[torch.Tensor], b: int, device) -> torch.Tensor:
    if t is None:
        return torch.zeros(b, dtype=torch.int32, device=device)
    checks.dtype(name, t, (torch.int32,))
    checks.shape(name, t, (b,))
    if t.device != device:
        raise InputError(f"{name} must be on {device}, got {t.device}")
    checks.contiguous(name, t)
    return t


def chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                               target_probs: torch.Tensor,
                               maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
                               maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
                               deterministic: bool = True,
                               generator: Optional[torch.Generator] = None, seed=None, offset=None):
    """Speculative-decoding verification of a chain of ``n`` draft tokens per request.

    Draft token i is accepted with probability ``min(1, p_i / q_i)`` (target / draft prob of that
    token); at the first rejection a replacement is drawn from ``max(p - q, 0)`` (renormalised);
    if all n pass, a bonus token is drawn from target row n. Outputs follow the target model.

    Parameters
    ----------
    draft_probs : torch.Tensor
        float32 ``[B, n, V]`` (copied when not contiguous).
    draft_token_ids : torch.Tensor
        int32/int64 ``[B, n]``. An id outside ``[0, V)`` is rejected.
    target_probs : torch.Tensor
        float32 ``[B, n + 1, V]`` (copied when not contiguous).
    maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num : torch.Tensor, optional
        int32 ``[B]``; when given, the counts are added into them (FlashInfer's accumulation)
        and they are returned.
    deterministic, generator, seed, offset
        As in :func:`fi_sampling.sampling.sampling_from_probs`.

    Returns
    -------
    tuple of torch.Tensor
        ``output_token_ids`` int32 ``[B, n + 1]`` (-1 after the first rejection's replacement),
        ``accepted_num`` int32 ``[B]`` (draft tokens that pass the test, each position judged
        independently), ``emitted_num`` int32 ``[B]`` (draft tokens emitted before the first
        rejection).

    Examples
    --------
    >>> d = torch.softmax(torch.randn(1, 2, 8), -1); t = torch.softmax(torch.randn(1, 3, 8), -1)
    >>> ids, acc, emi = chain_speculative_sampling(d, torch.tensor([[1, 2]]), t, seed=0)
    >>> ids.shape
    torch.Size([1, 3])
    """
    checks.dtype("draft_probs", draft_probs, (torch.float32,))
    checks.dtype("target_probs", target_probs, (torch.float32,))
    checks.dtype("draft_token_ids", draft_token_ids, (torch.int32, torch.int64))
    checks.ndim("draft_probs", draft_probs, (3,))
    b, n, v = draft_probs.shape
    if n == 0 or v == 0:
        raise InputError(f"draft_probs must have n >= 1 draft tokens and V >= 1, got shape {tuple(draft_probs.shape)}")
    checks.shape("draft_token_ids", draft_token_ids, (b, n))
    checks.shape("target_probs", target_probs, (b, n + 1, v), "[B, n + 1, V] of the draft probs")
    dev = checks.same_device(draft_probs=draft_probs, draft_token_ids=draft_token_ids,
                             target_probs=target_probs)
    draft_probs = draft_probs.contiguous()  # the kernel indexes [B, n, V] densely
    target_probs = target_probs.contiguous()
    ids = draft_token_ids.to(torch.int32).contiguous()
    acc = _counter("maybe_output_accepted_token_num", maybe_output_accepted_token_num, b, dev)
    emi = _counter("maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num, b, dev)
    rng = A.rng_args(generator, seed, offset, b, dev)
    out = torch.empty(b, n + 1, dtype=torch.int32, device=dev)
    args = (out, acc, emi, draft_probs, ids, target_probs, rng.seed_arr, rng.seed, rng.offset_arr,
            rng.offset, backend_for(CHAIN_SPECULATIVE, draft_probs))
    if torch.compiler.is_compiling():
        torch.ops.fi_sampling.chain_speculative_sampling(*args)
    else:
        _impl(*args)
    return out, acc, emi
