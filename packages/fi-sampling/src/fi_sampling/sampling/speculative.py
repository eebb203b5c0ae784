"""chain_speculative_sampling (FlashInfer-compatible). Runs the float64 reference (on the host)
for now: correct and seeded, not yet a kernel (it synchronises on CUDA inputs)."""

from __future__ import annotations

from typing import Optional

import torch

from fi_core import checks
from fi_core.errors import InputError

from . import _args as A
from . import reference
from ._core import make_op

CHAIN_SPECULATIVE = make_op("chain_speculative_sampling", kernel=False, stability="experimental")


def chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                               target_probs: torch.Tensor,
                               maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
                               maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
                               deterministic: bool = True,
                               generator: Optional[torch.Generator] = None, seed=None, offset=None):
    """Speculative-decoding verification of a chain of ``n`` draft tokens.

    Parameters
    ----------
    draft_probs : torch.Tensor
        float32 ``[B, n, V]``.
    draft_token_ids : torch.Tensor
        int32/int64 ``[B, n]``.
    target_probs : torch.Tensor
        float32 ``[B, n + 1, V]``.
    maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num : torch.Tensor, optional
        int32 ``[B]``; when given, the counts are added into them (FlashInfer's accumulation).

    Returns
    -------
    tuple of torch.Tensor
        ``output_token_ids`` int32 ``[B, n + 1]`` (-1 after the first rejection's replacement token),
        ``accepted_num`` int32 ``[B]`` (draft tokens that pass the test at each position),
        ``emitted_num`` int32 ``[B]`` (draft tokens emitted before the first rejection).

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
    checks.shape("draft_token_ids", draft_token_ids, (b, n))
    checks.shape("target_probs", target_probs, (b, n + 1, v), "[B, n + 1, V] of the draft probs")
    checks.same_device(draft_probs=draft_probs, draft_token_ids=draft_token_ids,
                       target_probs=target_probs)
    if draft_token_ids.numel() and int(draft_token_ids.min()) < 0:
        raise InputError("draft_token_ids must be >= 0")
    rng = A.rng_args(generator, seed, offset, b, draft_probs.device)
    s = rng.seed if rng.seed_arr is None else int(rng.seed_arr[0])
    o = rng.offset if rng.offset_arr is None else int(rng.offset_arr[0])
    out, acc, emi = reference.chain_speculative_sampling(draft_probs, draft_token_ids,
                                                         target_probs, s, o)
    dev = draft_probs.device
    out, acc, emi = out.to(dev), acc.to(dev), emi.to(dev)
    if maybe_output_accepted_token_num is not None:
        maybe_output_accepted_token_num.add_(acc)
        acc = maybe_output_accepted_token_num
    if maybe_output_emitted_draft_token_num is not None:
        maybe_output_emitted_draft_token_num.add_(emi)
        emi = maybe_output_emitted_draft_token_num
    return out, acc, emi
