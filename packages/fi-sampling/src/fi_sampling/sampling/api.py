"""Public sampling API (FlashInfer's ``flashinfer.sampling``): sorting-free, exact in distribution.

Common conventions
------------------
* ``probs`` / ``logits``: float32 ``[B, V]``, contiguous in the last dimension.
* ``indices``: optional int32/int64 ``[B_out]``; output row i samples from row ``indices[i]``.
  Without it ``B_out = B``. Per-row thresholds are indexed by output row.
* Thresholds: a Python scalar or a tensor ``[B_out]`` (int32/int64 for top_k, float32 otherwise).
  ``top_k <= 0`` in a tensor means no top-k filter.
* Randomness: ``seed``/``offset`` (int, or int64 CUDA tensors with 1 or ``B_out`` elements that the
  kernel reads at run time, so a captured CUDA graph replays with new values); otherwise drawn on
  the host from ``generator`` (default: the device's default generator), advancing it.
  Same seed/offset and inputs -> the same tokens (every reduction has a fixed order), so
  ``deterministic`` is accepted and always honoured.
* ``check_nan=True`` raises :class:`fi_core.errors.InputError` when the input has NaN (one
  reduction plus a host read: it synchronises). Without it, NaN and negative entries count as
  probability 0; a row with no positive probability returns token 0. Ids are always in range.
* Returns int32 token ids ``[B_out]``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _args as A
from ._core import MODES, THRESHOLD_MODES, backend_for, filtered_sampling, make_op, softmax_into, threshold

Threshold = Union[torch.Tensor, float]
TopK = Union[torch.Tensor, int]

SAMPLING_FROM_PROBS = make_op("sampling_from_probs")
SAMPLING_FROM_LOGITS = make_op("sampling_from_logits")
TOP_P_SAMPLING = make_op("top_p_sampling_from_probs")
TOP_K_SAMPLING = make_op("top_k_sampling_from_probs")
MIN_P_SAMPLING = make_op("min_p_sampling_from_probs")
TOP_K_TOP_P_FROM_PROBS = make_op("top_k_top_p_sampling_from_probs")
TOP_K_TOP_P_FROM_LOGITS = make_op("top_k_top_p_sampling_from_logits")
TOP_P_RENORM = make_op("top_p_renorm_probs", threshold=True)
TOP_K_RENORM = make_op("top_k_renorm_probs", threshold=True)
TOP_K_MASK = make_op("top_k_mask_logits", threshold=True)
SOFTMAX = make_op("softmax", threshold=True)


def _sample(op, probs, mode: str, indices, generator, check_nan, seed, offset,
            top_k=None, thr=None, thr_name="top_p", thr_lo=0.0, thr_lo_open=True, name="probs"):
    probs = A.matrix(name, probs)
    idx = A.indices_arg(indices, probs)
    rows = A.out_rows(probs, idx)
    k_arr, k = (None, 0)
    if top_k is not None:
        k_arr, k = A.threshold("top_k", top_k, rows, probs.device, integer=True, lo=1,
                               hi=2**31 - 1, lo_open=False)
    t_arr, t = (None, 0.0)
    if thr is not None:
        t_arr, t = A.threshold(thr_name, thr, rows, probs.device, integer=False, lo=thr_lo,
                               hi=1.0, lo_open=thr_lo_open)
    if check_nan:
        A.check_no_nan(name, probs)
    rng = A.rng_args(generator, seed, offset, rows, probs.device)
    out = torch.empty(rows, dtype=torch.int32, device=probs.device)
    filtered_sampling(out, probs, idx, MODES[mode], k_arr, int(k), t_arr, float(t), rng.seed_arr,
                      rng.seed, rng.offset_arr, rng.offset, backend_for(op, probs))
    return out


def sampling_from_probs(probs: torch.Tensor, indices: Optional[torch.Tensor] = None,
                        deterministic: bool = True, generator: Optional[torch.Generator] = None,
                        check_nan: bool = False, seed=None, offset=None) -> torch.Tensor:
    """Sample one token per row from (unnormalised) probabilities.

    Parameters
    ----------
    probs : torch.Tensor
        float32 ``[B, V]``. Rows need not sum to 1.
    indices, deterministic, generator, check_nan, seed, offset
        See the module docstring.

    Returns
    -------
    torch.Tensor
        int32 ``[B_out]`` token ids.

    Examples
    --------
    >>> probs = torch.softmax(torch.randn(4, 111), dim=-1)
    >>> sampling_from_probs(probs, seed=1, offset=0).shape
    torch.Size([4])

    See Also
    --------
    top_p_sampling_from_probs, top_k_sampling_from_probs, min_p_sampling_from_probs
    """
    return _sample(SAMPLING_FROM_PROBS, probs, "plain", indices, generator, check_nan, seed, offset)


def sampling_from_logits(logits: torch.Tensor, indices: Optional[torch.Tensor] = None,
                         deterministic: bool = True, generator: Optional[torch.Generator] = None,
                         check_nan: bool = False, seed=None, offset=None) -> torch.Tensor:
    """Sample from ``softmax(logits)``: float32 ``[B, V]`` logits -> int32 ``[B_out]`` ids.
    The softmax is fused into the sampling kernel (nothing is materialised). Rows without a
    finite maximum logit return token 0.

    Examples
    --------
    >>> sampling_from_logits(torch.randn(2, 111), seed=3).dtype
    torch.int32
    """
    return _sample(SAMPLING_FROM_LOGITS, logits, "plain_logits", indices, generator, check_nan,
                   seed, offset, name="logits")


def top_p_sampling_from_probs(probs: torch.Tensor, top_p: Threshold,
                              indices: Optional[torch.Tensor] = None, deterministic: bool = True,
                              generator: Optional[torch.Generator] = None, check_nan: bool = False,
                              seed=None, offset=None) -> torch.Tensor:
    """Nucleus sampling: token j is eligible iff the mass of the tokens strictly more probable
    than j is below ``top_p`` (ties at the cutoff are kept).

    Parameters
    ----------
    probs : torch.Tensor
        float32 ``[B, V]`` probabilities.
    top_p : float or torch.Tensor
        In (0, 1], or float32 ``[B_out]``.

    Returns
    -------
    torch.Tensor
        int32 ``[B_out]``.

    Examples
    --------
    >>> probs = torch.softmax(torch.randn(4, 111), dim=-1)
    >>> top_p_sampling_from_probs(probs, 0.9, seed=0).shape
    torch.Size([4])
    """
    return _sample(TOP_P_SAMPLING, probs, "top_p", indices, generator, check_nan, seed, offset,
                   thr=top_p)


def top_k_sampling_from_probs(probs: torch.Tensor, top_k: TopK,
                              indices: Optional[torch.Tensor] = None, deterministic: bool = True,
                              generator: Optional[torch.Generator] = None, check_nan: bool = False,
                              seed=None, offset=None) -> torch.Tensor:
    """Top-k sampling: token j is eligible iff fewer than ``top_k`` tokens are strictly more
    probable (ties with the k-th are kept).

    Parameters
    ----------
    probs : torch.Tensor
        float32 ``[B, V]``.
    top_k : int or torch.Tensor
        >= 1, or int32/int64 ``[B_out]`` (values <= 0 or >= V: no filter).

    Examples
    --------
    >>> probs = torch.softmax(torch.randn(4, 111), dim=-1)
    >>> top_k_sampling_from_probs(probs, 5, seed=0).shape
    torch.Size([4])
    """
    return _sample(TOP_K_SAMPLING, probs, "top_k", indices, generator, check_nan, seed, offset,
                   top_k=top_k)


def min_p_sampling_from_probs(probs: torch.Tensor, min_p: Threshold,
                              indices: Optional[torch.Tensor] = None, deterministic: bool = True,
                              generator: Optional[torch.Generator] = None, check_nan: bool = False,
                              seed=None, offset=None) -> torch.Tensor:
    """Min-p sampling: token j is eligible iff ``p_j >= min_p * max(p)``.

    Parameters
    ----------
    min_p : float or torch.Tensor
        In [0, 1], or float32 ``[B_out]``.

    Examples
    --------
    >>> probs = torch.softmax(torch.randn(4, 111), dim=-1)
    >>> min_p_sampling_from_probs(probs, 0.1, seed=0).shape
    torch.Size([4])
    """
    return _sample(MIN_P_SAMPLING, probs, "min_p", indices, generator, check_nan, seed, offset,
                   thr=min_p, thr_name="min_p", thr_lo=0.0, thr_lo_open=False)


def _check_order(filter_apply_order: str) -> None:
    if filter_apply_order not in ("top_k_first", "joint"):
        raise A.InputError(f"filter_apply_order must be 'top_k_first' or 'joint', got {filter_apply_order!r}")


def _gather(x: torch.Tensor, idx: Optional[torch.Tensor]) -> torch.Tensor:
    """The rows of x that ``idx`` (A.indices_arg's checked indices, or None) names."""
    return x if idx is None else x.index_select(0, idx)


def top_k_top_p_sampling_from_probs(probs: torch.Tensor, top_k: TopK, top_p: Threshold,
                                    indices: Optional[torch.Tensor] = None,
                                    filter_apply_order: str = "top_k_first",
                                    deterministic: bool = True,
                                    generator: Optional[torch.Generator] = None,
                                    check_nan: bool = False, seed=None, offset=None) -> torch.Tensor:
    """Top-k and top-p together. ``'top_k_first'``: top-k, renormalise, then top-p on the result;
    ``'joint'``: both filters on the original probabilities, in one kernel.

    Examples
    --------
    >>> probs = torch.softmax(torch.randn(4, 111), dim=-1)
    >>> top_k_top_p_sampling_from_probs(probs, 10, 0.9, seed=0).shape
    torch.Size([4])
    """
    _check_order(filter_apply_order)
    if filter_apply_order == "joint":
        return _sample(TOP_K_TOP_P_FROM_PROBS, probs, "joint", indices, generator, check_nan,
                       seed, offset, top_k=top_k, thr=top_p)
    A.matrix("probs", probs)
    idx = A.indices_arg(indices, probs)
    # top_p is checked again by the second step; here so that a bad one fails before any launch
    A.threshold("top_p", top_p, A.out_rows(probs, idx), probs.device, integer=False, lo=0.0, hi=1.0,
                lo_open=True)
    if check_nan:
        A.check_no_nan("probs", probs)
    renormed = top_k_renorm_probs(_gather(probs, idx), top_k)
    return top_p_sampling_from_probs(renormed, top_p, None, deterministic, generator, False, seed, offset)


def top_k_top_p_sampling_from_logits(logits: torch.Tensor, top_k: TopK, top_p: Threshold,
                                     indices: Optional[torch.Tensor] = None,
                                     filter_apply_order: str = "top_k_first",
                                     deterministic: bool = True,
                                     generator: Optional[torch.Generator] = None,
                                     check_nan: bool = False, seed=None, offset=None) -> torch.Tensor:
    """Top-k and top-p sampling from logits (``'top_k_first'``: mask the logits to the top k,
    softmax, then top-p; ``'joint'``: softmax, then both filters at once).

    Examples
    --------
    >>> top_k_top_p_sampling_from_logits(torch.randn(4, 111), 10, 0.9, seed=0).shape
    torch.Size([4])
    """
    _check_order(filter_apply_order)
    # One fused kernel: (top_k_first) the top-k cut on the logits, softmax over the kept set,
    # top-p; (joint) softmax computed on the fly, both filters at once. Rows without a finite
    # maximum logit return token 0.
    mode = "joint_logits" if filter_apply_order == "joint" else "top_k_first_logits"
    return _sample(TOP_K_TOP_P_FROM_LOGITS, logits, mode, indices, generator, check_nan, seed,
                   offset, top_k=top_k, thr=top_p, name="logits")


def _threshold_op(op, name, x, mode, top_k=None, top_p=None):
    x = A.matrix(name, x)
    rows = x.shape[0]
    k_arr, k, p_arr, p = None, 0, None, 1.0
    if top_k is not None:
        k_arr, k = A.threshold("top_k", top_k, rows, x.device, integer=True, lo=1,
                               hi=2**31 - 1, lo_open=False)
    if top_p is not None:
        p_arr, p = A.threshold("top_p", top_p, rows, x.device, integer=False, lo=0.0, hi=1.0,
                               lo_open=True)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    threshold(out, x, THRESHOLD_MODES[mode], k_arr, int(k), p_arr, float(p), backend_for(op, x))
    return out


def top_p_renorm_probs(probs: torch.Tensor, top_p: Threshold) -> torch.Tensor:
    """Keep the top-p set of each row (same rule as :func:`top_p_sampling_from_probs`), zero the
    rest, renormalise. float32 ``[B, V]`` -> float32 ``[B, V]``.

    Examples
    --------
    >>> p = torch.tensor([[0.5, 0.3, 0.2]])
    >>> top_p_renorm_probs(p, 0.6)
    tensor([[0.6250, 0.3750, 0.0000]])
    """
    return _threshold_op(TOP_P_RENORM, "probs", probs, "top_p_renorm", top_p=top_p)


def top_k_renorm_probs(probs: torch.Tensor, top_k: TopK) -> torch.Tensor:
    """Keep the top-k set of each row (ties with the k-th kept), zero the rest, renormalise.

    Examples
    --------
    >>> top_k_renorm_probs(torch.tensor([[0.5, 0.3, 0.2]]), 1)
    tensor([[1., 0., 0.]])
    """
    return _threshold_op(TOP_K_RENORM, "probs", probs, "top_k_renorm", top_k=top_k)


def top_k_mask_logits(logits: torch.Tensor, top_k: TopK) -> torch.Tensor:
    """Keep the top-k logits of each row (ties kept), set the rest to -inf.

    Examples
    --------
    >>> top_k_mask_logits(torch.tensor([[1.0, 3.0, 2.0]]), 2)
    tensor([[-inf, 3., 2.]])
    """
    return _threshold_op(TOP_K_MASK, "logits", logits, "top_k_mask", top_k=top_k)


def softmax(logits: torch.Tensor, temperature: Optional[Threshold] = None,
            enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """``softmax(logits / temperature)`` per row, float32 ``[B, V]`` -> float32 ``[B, V]``.

    Parameters
    ----------
    temperature : float or torch.Tensor, optional
        > 0, or float32 ``[B]`` (one per row). Default 1.
    enable_pdl : bool, optional
        Accepted for FlashInfer compatibility; ignored.

    Examples
    --------
    >>> softmax(torch.zeros(1, 4))
    tensor([[0.2500, 0.2500, 0.2500, 0.2500]])
    """
    x = A.matrix("logits", logits)
    t_arr, t = None, 1.0
    if temperature is not None:
        if isinstance(temperature, torch.Tensor):
            t_arr, _ = A.threshold("temperature", temperature, x.shape[0], x.device,
                                   integer=False, lo=0.0, hi=float("inf"), lo_open=True)
        else:
            _, t = A.threshold("temperature", temperature, x.shape[0], x.device, integer=False,
                               lo=0.0, hi=float("inf"), lo_open=True)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    softmax_into(out, x, t_arr, float(t), backend_for(SOFTMAX, x))
    return out
