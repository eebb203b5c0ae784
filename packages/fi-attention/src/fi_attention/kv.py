"""Paged-KV cache helpers shared by decode, append and prefill.

A paged cache is either one tensor ``[P, 2, page_size, H, D]`` (NHD) / ``[P, 2, H, page_size, D]``
(HND) whose dim 1 holds K (0) and V (1), or a tuple ``(k_cache, v_cache)`` of
``[P, page_size, H, D]`` (NHD) / ``[P, H, page_size, D]`` (HND). Any view is accepted as long as
the last dimension is contiguous: kernels receive base pointers and element strides for the page,
token and head dimensions, so a slice of a larger cache needs no copy.

Example
-------
>>> import torch
>>> cache = torch.zeros(4, 2, 16, 8, 128, dtype=torch.bfloat16)
>>> kv = unpack_paged_kv_cache(cache, "NHD")
>>> (kv.page_size, kv.num_kv_heads, kv.head_dim, kv.k_strides)
(16, 8, 128, (32768, 1024, 128))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from fi_core.errors import InputError, InputTypeError

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
KV_LAYOUTS = ("NHD", "HND")

PagedKVCache = Union[torch.Tensor, tuple]


def check_kv_layout(kv_layout: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise InputError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return kv_layout


def check_last_page_len(name: str, last_page_len: torch.Tensor, pages: torch.Tensor, page_size: int) -> None:
    """Every request with pages fills 1 .. page_size slots of its last page (a request without
    pages may carry any value). Reads the values: host tensors, or FI_CHECK_INPUTS=1."""
    last, pages = last_page_len.to("cpu", torch.int64), pages.to("cpu", torch.int64)
    bad = torch.nonzero((pages > 0) & ((last < 1) | (last > page_size)))
    if bad.numel():
        i = int(bad[0, 0])
        raise InputError(f"{name} must be in [1, page_size={page_size}]; request {i} has {int(last[i])}")


@dataclass(frozen=True)
class PagedKV:
    """A validated paged cache: K and V as 4-D views in the user's layout plus kernel strides.

    ``k``/``v``: ``[P, page_size, H, D]`` (NHD) or ``[P, H, page_size, D]`` (HND) views (no copy).
    ``k_strides``/``v_strides``: element strides ``(page, token, head)``; the head_dim stride is 1.
    """

    k: torch.Tensor
    v: torch.Tensor
    layout: str
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    k_strides: tuple[int, int, int]
    v_strides: tuple[int, int, int]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def k_ptr(self) -> int:
        return self.k.data_ptr()

    def v_ptr(self) -> int:
        return self.v.data_ptr()


def _strides(t: torch.Tensor, layout: str) -> tuple[int, int, int]:
    s = t.stride()
    if layout == "NHD":  # [P, ps, H, D]
        return (s[0], s[1], s[2])
    return (s[0], s[2], s[1])  # [P, H, ps, D]: token stride is dim 2


def unpack_paged_kv_cache(paged_kv_cache: PagedKVCache, kv_layout: str = "NHD", *,
                          name: str = "paged_kv_cache", vector_bytes: int = 16) -> PagedKV:
    """Split and validate a paged cache (tensor or (k, v) tuple).

    Parameters
    ----------
    paged_kv_cache : torch.Tensor or tuple of two torch.Tensor
        ``[P, 2, ps, H, D]`` / ``[P, 2, H, ps, D]`` or ``(k [P, ps, H, D], v [P, ps, H, D])``
        (HND: ``[P, H, ps, D]``), dtype float16, bfloat16, float8_e4m3fn or float8_e5m2.
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    vector_bytes : int
        Alignment (bytes) the kernels need for every row start: base pointers and strides of
        the page/token/head dims must be multiples of it (16 for 128-bit loads). 0 skips it.

    Returns
    -------
    PagedKV
    """
    check_kv_layout(kv_layout)
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            want = "[P, 2, page_size, H, D]" if kv_layout == "NHD" else "[P, 2, H, page_size, D]"
            raise InputError(f"{name} must be a tensor {want} ({kv_layout}) or a (k, v) tuple, "
                             f"got shape {tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    elif isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise InputError(f"{name} tuple must be (k_cache, v_cache), got {len(paged_kv_cache)} items")
        k, v = paged_kv_cache
        for nm, t in (("k_cache", k), ("v_cache", v)):
            if not isinstance(t, torch.Tensor):
                raise InputTypeError(f"{name}: {nm} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                want = "[P, page_size, H, D]" if kv_layout == "NHD" else "[P, H, page_size, D]"
                raise InputError(f"{name}: {nm} must be 4-D {want} ({kv_layout}), got shape {tuple(t.shape)}")
        if k.shape != v.shape:
            raise InputError(f"{name}: k_cache and v_cache must have the same shape, got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != v.dtype or k.device != v.device:
            raise InputTypeError(f"{name}: k_cache and v_cache must share dtype and device, got "
                                 f"{k.dtype}/{k.device} and {v.dtype}/{v.device}")
    else:
        raise InputTypeError(f"{name} must be a torch.Tensor or a (k, v) tuple, got {type(paged_kv_cache).__name__}")
    if k.dtype not in KV_DTYPES:
        raise InputTypeError(f"{name} must be float16, bfloat16, float8_e4m3fn or float8_e5m2, "
                             f"got {str(k.dtype).replace('torch.', '')}")
    for nm, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise InputError(f"{name}: the head_dim dimension of {nm} must be contiguous (stride 1), "
                             f"got strides {t.stride()}")
    if kv_layout == "NHD":
        num_pages, page_size, heads, dim = k.shape
    else:
        num_pages, heads, page_size, dim = k.shape
    ks, vs = _strides(k, kv_layout), _strides(v, kv_layout)
    if vector_bytes and k.device.type == "cuda":
        esz = k.element_size()
        for nm, t, st in (("k", k, ks), ("v", v, vs)):
            if t.data_ptr() % vector_bytes or any((s * esz) % vector_bytes for s in st):
                raise InputError(
                    f"{name}: {nm} rows must start at {vector_bytes}-byte boundaries for vector "
                    f"loads; got base address % {vector_bytes} = {t.data_ptr() % vector_bytes} and "
                    f"strides (page, token, head) {st} elements of {esz} bytes")
    return PagedKV(k, v, kv_layout, num_pages, page_size, heads, dim, ks, vs)


def to_nhd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A ``[P, ps, H, D]`` view of one cache half in either layout (no copy)."""
    return t if layout == "NHD" else t.transpose(1, 2)
