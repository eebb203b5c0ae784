"""Host-side checks of a decode batch's page table and the token count of each request.

plan() runs these on every call, so they are written for numpy's per-call overhead (about a
microsecond per ufunc call on small arrays, whatever the batch): a uniform batch is recognised by
comparing bytes and then needs no reduction at all.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

from fi_core import checks
from fi_core.errors import InputError

from .planner import kv_lengths


def host_i32(name: str, t: torch.Tensor) -> np.ndarray:
    """A 1-D int32 tensor as a numpy array: a view of a CPU tensor, a copy of a device one."""
    checks.int32_vector(name, t)
    return t.numpy() if t.is_cpu else t.cpu().numpy()


def request_lengths(indptr: np.ndarray, last_page_len: np.ndarray, page_size: int,
                    num_indices: int) -> Union[int, np.ndarray]:
    """Validate a page table and return each request's token count.

    Parameters
    ----------
    indptr : np.ndarray
        int32 ``[B + 1]``: request b owns page slots ``indptr[b]:indptr[b + 1]``.
    last_page_len : np.ndarray
        int32 ``[B]``: tokens in each request's last page, in ``[1, page_size]`` (any value for a
        request without pages).
    page_size : int
    num_indices : int
        Entries of the page index array (``indptr[-1]`` must not exceed it).

    Returns
    -------
    int or np.ndarray
        The common length when every request has the same page count and last-page length (the
        planner caches such plans by their scalars), else int64 ``[B]`` lengths.

    Examples
    --------
    >>> request_lengths(np.array([0, 2, 4], np.int32), np.array([3, 3], np.int32), 16, 4)
    19
    >>> request_lengths(np.array([0, 2, 2], np.int32), np.array([3, 7], np.int32), 16, 4).tolist()
    [19, 0]
    """
    batch = indptr.shape[0] - 1
    if batch < 0 or last_page_len.shape[0] != batch:
        raise InputError(f"indptr must have batch + 1 entries and last_page_len batch entries, "
                         f"got {indptr.shape[0]} and {last_page_len.shape[0]}")
    if not batch:
        return 0
    pages = indptr[1:] - indptr[:-1]
    pb, lb = pages.tobytes(), last_page_len.tobytes()
    if pb == pb[:4] * batch and lb == lb[:4] * batch:  # one page count, one last-page length
        p, last = int(pages[0]), int(last_page_len[0])
        _check_table(indptr, p, num_indices)
        if p == 0:
            return 0
        if not 1 <= last <= page_size:
            _bad_last_page_len(pages, last_page_len, page_size)
        return (p - 1) * page_size + last
    min_pages = int(pages.min())
    _check_table(indptr, min_pages, num_indices)
    if last_page_len.min() < 1 or last_page_len.max() > page_size:
        _bad_last_page_len(pages, last_page_len, page_size)
    if min_pages > 0:  # every request has pages: no zero-length special case
        return pages.astype(np.int64) * page_size - (page_size - last_page_len)
    return kv_lengths(indptr, last_page_len, page_size)


def _check_table(indptr: np.ndarray, min_pages: int, num_indices: int) -> None:
    if indptr[0] != 0 or min_pages < 0:
        raise InputError(f"indptr must start at 0 and be non-decreasing, got {indptr.tolist()[:16]}")
    if indptr[-1] > num_indices:
        raise InputError(f"indptr[-1] = {indptr[-1]} exceeds the {num_indices} page indices")


def _bad_last_page_len(pages: np.ndarray, last_page_len: np.ndarray, page_size: int) -> None:
    """Raise for the first request with pages whose last_page_len is out of range; a request
    without pages may carry any value."""
    bad = (pages > 0) & ((last_page_len < 1) | (last_page_len > page_size))
    if np.any(bad):
        i = int(np.nonzero(bad)[0][0])
        raise InputError(f"last_page_len must be in [1, page_size={page_size}]; request {i} has "
                         f"{last_page_len[i]}")
