"""Bit packing of boolean masks (numpy.packbits semantics), as FlashInfer's
``flashinfer.quantization.packbits`` / ``segment_packbits``. The attention kernels read custom
masks packed with ``bitorder="little"`` (bit ``i`` of a segment is bit ``i % 8`` of byte
``i // 8``); the public default is numpy's ``"big"``, as in FlashInfer."""

from __future__ import annotations

import torch

from fi_core import checks
from fi_core.errors import InputError, InputTypeError

__all__ = ["packbits", "segment_packbits"]

_BIG = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_LITTLE = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _weights(bitorder: str, device) -> torch.Tensor:
    if bitorder == "big":
        return _BIG.to(device)
    if bitorder == "little":
        return _LITTLE.to(device)
    raise InputError(f"bitorder must be 'big' or 'little', got {bitorder!r}")


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """Pack a 1-D binary array into uint8, zero-padded to whole bytes.

    Parameters
    ----------
    x : torch.Tensor
        1-D, any dtype; nonzero = 1.
    bitorder : str
        ``"big"`` (numpy's default: first element in the most significant bit) or ``"little"``.

    Returns
    -------
    torch.Tensor
        uint8 ``[(len(x) + 7) // 8]`` on ``x.device``.

    Examples
    --------
    >>> import torch
    >>> packbits(torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool)).tolist()
    [179]
    >>> packbits(torch.tensor([1, 0, 1]), bitorder="little").tolist()
    [5]
    """
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise InputError(f"x must be 1-D, got shape {tuple(x.shape)}")
    w = _weights(bitorder, x.device)
    n = x.shape[0]
    nbytes = (n + 7) // 8
    bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=x.device)
    bits[:n] = (x != 0).to(torch.uint8)
    return (bits.view(nbytes, 8) * w).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"):
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` separately (each padded to whole bytes).

    Parameters
    ----------
    x : torch.Tensor
        1-D binary array ``[indptr[-1]]``.
    indptr : torch.Tensor
        int ``[batch + 1]``, non-decreasing, ``indptr[0] == 0``.
    bitorder : str
        ``"big"`` or ``"little"``.

    Returns
    -------
    packed : torch.Tensor
        uint8 ``[new_indptr[-1]]``.
    new_indptr : torch.Tensor
        int32 ``[batch + 1]`` with ``new_indptr[i+1] - new_indptr[i] == (len_i + 7) // 8``.

    Examples
    --------
    >>> import torch
    >>> x = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    >>> y, ind = segment_packbits(x, torch.tensor([0, 4, 7, 11]), bitorder="big")
    >>> [bin(b) for b in y.tolist()], ind.tolist()
    (['0b10110000', '0b100000', '0b11010000'], [0, 1, 2, 3])
    """
    if not isinstance(x, torch.Tensor) or not isinstance(indptr, torch.Tensor):
        raise InputTypeError("x and indptr must be torch.Tensor")
    if x.dim() != 1 or indptr.dim() != 1 or indptr.numel() < 1:
        raise InputError(f"x must be 1-D and indptr 1-D non-empty, got shapes {tuple(x.shape)} "
                         f"and {tuple(indptr.shape)}")
    if indptr.dtype not in (torch.int32, torch.int64):
        raise InputTypeError(f"indptr must be int32 or int64, got {str(indptr.dtype).replace('torch.', '')}")
    w = _weights(bitorder, x.device)
    checks.indptr_values("indptr", indptr, x.shape[0], end_name="len(x)")
    ind = indptr.to("cpu", torch.int64)
    lens = ind[1:] - ind[:-1]
    nbytes = (lens + 7) // 8
    new_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    torch.cumsum(nbytes, 0, out=new_indptr[1:])
    total = int(new_indptr[-1])
    dev = x.device
    seg = torch.repeat_interleave(torch.arange(len(lens)), nbytes).to(dev)
    local = torch.arange(total, device=dev) - new_indptr[:-1].to(dev)[seg]
    pos = ind[:-1].to(dev)[seg][:, None] + local[:, None] * 8 + torch.arange(8, device=dev)[None, :]
    valid = pos < ind[1:].to(dev)[seg][:, None]
    xb = (x != 0).to(torch.uint8)
    bits = torch.where(valid, xb[pos.clamp(max=max(x.shape[0] - 1, 0))] if x.shape[0] else
                       torch.zeros_like(pos, dtype=torch.uint8), torch.zeros((), dtype=torch.uint8, device=dev))
    packed = (bits * w).sum(dim=1, dtype=torch.int32).to(torch.uint8)
    return packed, new_indptr.to(device=indptr.device, dtype=torch.int32)
