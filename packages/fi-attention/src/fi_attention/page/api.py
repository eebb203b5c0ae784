"""Page management: append_paged_kv_cache, get_batch_indices_positions, get_seq_lens."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from fi_core import Arch, Backend, Entry, KernelSpec, OpInfo, arch_of, checks, knobs, load, register_op
from fi_core.dtypes import cuda_type, tag
from fi_core.errors import InputError, InputTypeError
from fi_core.launch import current_stream, on_device

from ..kv import KV_DTYPES, check_last_page_len, unpack_paged_kv_cache
from ..reference import paged_kv_halves

_HERE = Path(__file__).resolve().parent


@functools.cache
def append_spec(dtype: torch.dtype, arch: Arch) -> KernelSpec:
    return KernelSpec(
        name=f"append_paged_kv_{tag(dtype)}", sources=(_HERE / "append.cu",), arch=arch,
        defines={"FI_T": cuda_type(dtype)},
        entries=(Entry("fi_append_paged_kv_cache",
                       ("ptr", "i64", "i64", "ptr", "i64", "i64", "ptr", "ptr", "ptr", "i64", "i64",
                        "i64", "ptr", "i64", "i64", "i64", "ptr", "ptr", "i64", "i64", "i64", "i64",
                        "stream")),),
        package="fi_attention")


APPEND = register_op(OpInfo(
    name="append_paged_kv_cache", family="fi-attention", api="flashinfer.page.append_paged_kv_cache",
    backends=(Backend("cuda", min_arch="8.0", dtypes=KV_DTYPES),
              Backend("reference", devices=("cpu", "cuda"), notes="pure torch")),
    specs=lambda arch: [append_spec(torch.bfloat16, arch)],
))


_i32 = checks.int32_vector


def _check_append_targets(batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len, page_size,
                          num_pages) -> None:
    """Every appended token lands inside its request's pages, and those pages inside the cache
    (FI_CHECK_INPUTS=1 on a GPU, always on the CPU: these read device values)."""
    checks.indptr_values("kv_indptr", kv_indptr, kv_indices.numel(), end_name="len(kv_indices)")
    checks.index_values("batch_indices", batch_indices, kv_last_page_len.numel(), " (the page table's requests)")
    pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    check_last_page_len("kv_last_page_len", kv_last_page_len, pages, page_size)
    seq = torch.clamp(pages - 1, min=0) * page_size + torch.where(pages > 0, kv_last_page_len.long(), 0)
    b = batch_indices.long()
    bad = torch.nonzero((positions < 0) | (positions.long() >= seq[b]))
    if bad.numel():
        i = int(bad[0, 0])
        raise InputError(f"positions must lie in [0, seq_len) of their request (the page table is the one "
                         f"after the append); token {i} of request {int(b[i])} has position "
                         f"{int(positions[i])}, its length is {int(seq[b[i]])}")
    page_ids = kv_indices[kv_indptr[:-1].long()[b] + positions.long() // page_size]
    checks.index_values("page indices of appended tokens", page_ids, num_pages)


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token count of each request: ``max(pages - 1, 0) * page_size + last_page_len``.

    Parameters
    ----------
    kv_indptr : torch.Tensor
        int32 ``[batch + 1]``.
    kv_last_page_len : torch.Tensor
        int32 ``[batch]``.
    page_size : int

    Returns
    -------
    torch.Tensor
        int32 ``[batch]``, on the inputs' device.

    Examples
    --------
    >>> get_seq_lens(torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([5, 1], dtype=torch.int32), 16)
    tensor([21,  1], dtype=torch.int32)
    """
    _i32("kv_indptr", kv_indptr)
    _i32("kv_last_page_len", kv_last_page_len)
    page_size = checks.int_value("page_size", page_size, 1)
    checks.same_device(kv_indptr=kv_indptr, kv_last_page_len=kv_last_page_len)
    if kv_indptr.numel() != kv_last_page_len.numel() + 1:
        raise InputError(f"kv_indptr must have len(kv_last_page_len) + 1 = {kv_last_page_len.numel() + 1} "
                         f"entries, got {kv_indptr.numel()}")
    pages = kv_indptr[1:] - kv_indptr[:-1]
    if kv_indptr.device.type == "cpu" or knobs.check_inputs():  # reads device values
        checks.indptr_values("kv_indptr", kv_indptr)
        check_last_page_len("kv_last_page_len", kv_last_page_len, pages, page_size)
    return (torch.clamp(pages - 1, min=0) * page_size + kv_last_page_len).to(torch.int32)


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int):
    """Request index and position of every appended token, without a device synchronisation.

    Token ``j`` of request ``b``'s append (``append_indptr[b] <= j < append_indptr[b+1]``) sits at
    position ``seq_lens[b] - append_len_b + (j - append_indptr[b])``; ``seq_lens`` are the lengths
    after the append.

    Parameters
    ----------
    append_indptr : torch.Tensor
        int32 ``[batch + 1]``.
    seq_lens : torch.Tensor
        int32 ``[batch]``.
    nnz : int
        ``append_indptr[-1]``, given so that no device value has to be read (checked against it,
        with ``seq_lens`` against the append lengths, on CPU tensors and with ``FI_CHECK_INPUTS=1``).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``batch_indices`` and ``positions``, int32 ``[nnz]``.

    Examples
    --------
    >>> b, p = get_batch_indices_positions(torch.tensor([0, 2, 3], dtype=torch.int32),
    ...                                    torch.tensor([5, 9], dtype=torch.int32), 3)
    >>> b.tolist(), p.tolist()
    ([0, 0, 1], [3, 4, 8])
    """
    _i32("append_indptr", append_indptr)
    _i32("seq_lens", seq_lens)
    checks.same_device(append_indptr=append_indptr, seq_lens=seq_lens)
    if append_indptr.numel() != seq_lens.numel() + 1:
        raise InputError(f"append_indptr must have len(seq_lens) + 1 = {seq_lens.numel() + 1} "
                         f"entries, got {append_indptr.numel()}")
    nnz = checks.int_value("nnz (append_indptr[-1])", nnz, 0)
    if append_indptr.device.type == "cpu" or knobs.check_inputs():  # reads device values
        checks.indptr_values("append_indptr", append_indptr)
        if int(append_indptr[-1]) != nnz:
            raise InputError(f"nnz must equal append_indptr[-1] = {int(append_indptr[-1])}, got {nnz}")
        short = torch.nonzero(append_indptr[1:] - append_indptr[:-1] > seq_lens)
        if short.numel():
            b = int(short[0, 0])
            raise InputError(f"seq_lens are the lengths after the append, so each must be >= its append "
                             f"length; request {b} appends {int(append_indptr[b + 1] - append_indptr[b])} "
                             f"tokens to a length of {int(seq_lens[b])}")
    counts = (append_indptr[1:] - append_indptr[:-1]).long()
    batch = torch.arange(seq_lens.numel(), device=seq_lens.device)
    bi = torch.repeat_interleave(batch, counts, output_size=nnz)
    start = (seq_lens.long() - counts)[bi]
    pos = torch.arange(nnz, device=seq_lens.device) - append_indptr.long()[bi] + start
    return bi.to(torch.int32), pos.to(torch.int32)


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor,
                          batch_indices: torch.Tensor, positions: torch.Tensor, paged_kv_cache,
                          kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_last_page_len: torch.Tensor, kv_layout: str = "NHD") -> None:
    """Write appended keys/values into a paged KV cache in place.

    Parameters
    ----------
    append_key, append_value : torch.Tensor
        ``[nnz, num_kv_heads, head_dim]`` in the cache's dtype, contiguous head_dim.
    batch_indices, positions : torch.Tensor
        int32 ``[nnz]`` (see :func:`get_batch_indices_positions`).
    paged_kv_cache : torch.Tensor or tuple
        See shared/API.md (tensor or ``(k, v)``, NHD or HND).
    kv_indices, kv_indptr, kv_last_page_len : torch.Tensor
        int32 page table *after* the append (the pages must already be allocated).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.

    Shapes, dtypes and table lengths are always checked. That every token lands inside its
    request's pages and those inside the cache reads the tables' values: it is checked on CPU
    tensors always and on a GPU with ``FI_CHECK_INPUTS=1``.
    """
    kv = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    for name, t in (("batch_indices", batch_indices), ("positions", positions), ("kv_indices", kv_indices),
                    ("kv_indptr", kv_indptr), ("kv_last_page_len", kv_last_page_len)):
        _i32(name, t)
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != kv.dtype:
            raise InputTypeError(f"{name} must have the cache's dtype {kv.dtype}, got {t.dtype}")
        if t.dim() != 3 or t.shape[1:] != (kv.num_kv_heads, kv.head_dim):
            raise InputError(f"{name} must be [nnz, {kv.num_kv_heads}, {kv.head_dim}], got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise InputError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    # A kernel given a host pointer faults and takes the CUDA context with it: one device for all.
    checks.same_device(paged_kv_cache=kv.k, append_key=append_key, append_value=append_value,
                       batch_indices=batch_indices, positions=positions, kv_indices=kv_indices,
                       kv_indptr=kv_indptr, kv_last_page_len=kv_last_page_len)
    nnz = append_key.shape[0]
    if append_value.shape[0] != nnz or batch_indices.numel() != nnz or positions.numel() != nnz:
        raise InputError(f"append_key, append_value, batch_indices and positions must have nnz rows, got "
                         f"{nnz}, {append_value.shape[0]}, {batch_indices.numel()}, {positions.numel()}")
    if kv_last_page_len.numel() + 1 != kv_indptr.numel():
        raise InputError(f"kv_indptr must have len(kv_last_page_len) + 1 = {kv_last_page_len.numel() + 1} "
                         f"entries, got {kv_indptr.numel()}")
    if nnz and (kv.device.type == "cpu" or knobs.check_inputs()):  # reads device values
        _check_append_targets(batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len,
                              kv.page_size, kv.num_pages)
    if isinstance(paged_kv_cache, torch.Tensor):
        cache_a, cache_b = paged_kv_cache, None
    else:
        cache_a, cache_b = paged_kv_cache
    args = (append_key, append_value, batch_indices, positions, cache_a, cache_b, kv_indices, kv_indptr,
            kv_last_page_len, kv_layout)
    if torch.compiler.is_compiling():
        torch.ops.fi_attention.append_paged_kv_cache(*args)
    else:
        _append_core(*args)


def _append_core(append_key, append_value, batch_indices, positions, cache_a, cache_b, kv_indices,
                 kv_indptr, kv_last_page_len, kv_layout) -> None:
    paged_kv_cache = cache_a if cache_b is None else (cache_a, cache_b)
    kv = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    nnz = append_key.shape[0]
    if kv.device.type != "cuda" or APPEND.choose(kv.device, kv.dtype).name != "cuda":
        _append_reference(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_layout)
        return
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        es = t.element_size()
        if t.data_ptr() % 16 or (t.stride(0) * es) % 16 or (t.stride(1) * es) % 16 or (kv.head_dim * es) % 16:
            raise InputError(f"{name} rows must be 16-byte aligned for vector copies, got strides {t.stride()}")
    mod = load(append_spec(kv.dtype, arch_of(kv.device)))
    with on_device(kv.device):
        mod.fi_append_paged_kv_cache(
            append_key.data_ptr(), append_key.stride(0), append_key.stride(1),
            append_value.data_ptr(), append_value.stride(0), append_value.stride(1),
            batch_indices.data_ptr(), positions.data_ptr(),
            kv.k_ptr(), *kv.k_strides, kv.v_ptr(), *kv.v_strides,
            kv_indices.data_ptr(), kv_indptr.data_ptr(), nnz, kv.page_size, kv.num_kv_heads,
            kv.head_dim, current_stream(kv.device))


@torch.library.custom_op("fi_attention::append_paged_kv_cache", mutates_args=("cache_a", "cache_b"))
def _append_op(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
               positions: torch.Tensor, cache_a: torch.Tensor, cache_b: Optional[torch.Tensor],
               kv_indices: torch.Tensor, kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor,
               kv_layout: str) -> None:
    _append_core(append_key, append_value, batch_indices, positions, cache_a, cache_b, kv_indices,
                 kv_indptr, kv_last_page_len, kv_layout)


@_append_op.register_fake
def _(append_key, append_value, batch_indices, positions, cache_a, cache_b, kv_indices, kv_indptr,
      kv_last_page_len, kv_layout) -> None:
    return None


def _append_reference(key, value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                      kv_layout):
    k, v = paged_kv_halves(paged_kv_cache, kv_layout)  # [P, ps, H, D] views into the cache
    ps = k.shape[1]
    b = batch_indices.long()
    pos = positions.long()
    page = kv_indices.long()[kv_indptr.long()[b] + pos // ps]
    k[page, pos % ps] = key
    v[page, pos % ps] = value
