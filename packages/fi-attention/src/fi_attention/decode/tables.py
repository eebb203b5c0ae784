"""Host-side checks of a decode batch's page table and the token count of each request.

plan() runs these on every call, so they are written for numpy's per-call overhead (about half a
microsecond per ufunc call on small arrays and about a microsecond per reduction, whatever the
batch): a uniform batch is recognised by comparing bytes and then needs no reduction at all; a
ragged one takes its extremes with argmin/argmax (a few hundred ns each) and its lengths with
three ufunc calls against a 0-d page-size array.
"""

from __future__ import annotations

import functools
from typing import Union

import numpy as np
import torch

from fi_core import checks
from fi_core.errors import InputError

from ..kv import check_last_page_len
from .planner import const_i64, kv_lengths


_Tensor = torch.Tensor
_INT32 = torch.int32
_I32_MAX = 0x7FFFFFFF


def host_i32(name: str, t: torch.Tensor) -> np.ndarray:
    """A 1-D int32 tensor as a numpy array: a view of a CPU tensor, a copy of a device one."""
    checks.int32_vector(name, t)
    return t.numpy() if t.is_cpu else t.cpu().numpy()


def host_tables(indptr: torch.Tensor, last_page_len: torch.Tensor) -> tuple:
    """:func:`host_i32` of ``indptr`` and then ``last_page_len``, with the checks inlined for
    the usual pair of plain 1-D int32 CPU tensors (anything else goes through host_i32, which
    raises the errors)."""
    if (type(indptr) is _Tensor and type(last_page_len) is _Tensor and indptr.dtype is _INT32
            and last_page_len.dtype is _INT32 and indptr.is_cpu and last_page_len.is_cpu
            and indptr.dim() == 1 and last_page_len.dim() == 1):
        return indptr.numpy(), last_page_len.numpy()
    return host_i32("indptr", indptr), host_i32("last_page_len", last_page_len)


def request_lengths(indptr: np.ndarray, last_page_len: np.ndarray, page_size: int,
                    num_indices: int, lengths: bool = True) -> Union[int, np.ndarray, None]:
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
    lengths : bool
        False: return None instead of the lengths of a non-uniform batch (the native planner
        reads the table itself).

    Returns
    -------
    int, np.ndarray or None
        The common length when every request has the same page count and last-page length (the
        planner caches such plans by their scalars), else int64 ``[B]`` lengths (or None).

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
    pb = pages.tobytes()
    if pb == pb[:4] * batch and (lb := last_page_len.tobytes()) == lb[:4] * batch:
        # one page count, one last-page length
        p, last = pages.item(0), last_page_len.item(0)
        _check_table(indptr, p, num_indices)
        if p == 0:
            return 0
        if not 1 <= last <= page_size:
            _bad_last_page_len(pages, last_page_len, page_size)
        return (p - 1) * page_size + last
    min_pages = pages.item(pages.argmin())
    _check_table(indptr, min_pages, num_indices)
    if min_pages > 0 and type(page_size) is int and page_size <= _I32_MAX:
        # Every request has pages (the usual ragged batch): (pages - 1) * page_size + last, in
        # int64. (A page size beyond int32, or not an int, takes the general path below, whose
        # errors it keeps.)
        if (last_page_len.item(last_page_len.argmin()) < 1
                or last_page_len.item(last_page_len.argmax()) > page_size):
            _bad_last_page_len(pages, last_page_len, page_size)
        if not lengths:
            return None
        ps = _page_size_array(page_size)
        lens = np.multiply(pages, ps)
        lens += last_page_len
        lens -= ps
        return lens
    if last_page_len[last_page_len.argmin()] < 1 or last_page_len[last_page_len.argmax()] > page_size:
        _bad_last_page_len(pages, last_page_len, page_size)
    if not lengths:
        return None
    if min_pages > 0:  # every request has pages: no zero-length special case
        return pages.astype(np.int64) * page_size - (page_size - last_page_len)
    return kv_lengths(indptr, last_page_len, page_size)


@functools.lru_cache(maxsize=64)
def _page_size_array(page_size: int) -> np.ndarray:
    """``page_size`` as a read-only 0-d int64 array (see planner.const_i64), one per page size (a
    plan option)."""
    return const_i64(page_size)


def _check_table(indptr: np.ndarray, min_pages: int, num_indices: int) -> None:
    if indptr.item(0) != 0 or min_pages < 0:
        raise InputError(f"indptr must start at 0 and be non-decreasing, got {indptr.tolist()[:16]}")
    if indptr.item(-1) > num_indices:
        raise InputError(f"indptr[-1] = {indptr[-1]} exceeds the {num_indices} page indices")


def _bad_last_page_len(pages: np.ndarray, last_page_len: np.ndarray, page_size: int) -> None:
    """Raise for the first request with pages whose last_page_len is out of range; a request
    without pages may carry any value."""
    check_last_page_len("last_page_len", torch.tensor(last_page_len), torch.tensor(pages), page_size)
