"""single_decode_with_kv_cache: one query token against a contiguous K/V, on the batch kernel.

The contiguous ``[L, H, D]`` K/V is presented to the paged kernel as a single page whose size is
the next power of two >= L (the page arithmetic becomes shifts and never leaves page 0); the
split-KV plan for L is cached per device, so repeated calls upload no metadata.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from fi_core import arch_of, checks, device_info, load
from fi_core.errors import InputError, InputTypeError

from ..kv import check_kv_layout
from ..reference import attention_reference
from . import common
from .batch import _ctas_per_sm
from .launch import GRID_MERGE, INDICES_EARLY, PDL, TABLES_EARLY, DecodeArgs, capturing, raw_stream
from .planner import plan_decode
from .spec import heads_per_cta, select_spec, small_mha_grid


@functools.lru_cache(maxsize=256)
def _single_meta(device: torch.device, kv_len: int, kv_units: int, sm: int, ctas: int):
    """Device int32 metadata for one request of kv_len tokens: work | num_work | merge_indptr |
    indptr | indices | last_page_len, plus (num_items, num_slots, split, offsets)."""
    plan = plan_decode(torch.tensor([kv_len]).numpy(), kv_units=kv_units, sm_count=sm, ctas_per_sm=ctas)
    n = plan.num_items
    host = plan.work.reshape(-1).tolist() + [n, 0, 0, 0] + plan.merge_indptr.tolist() + [0, 1, 0, kv_len]
    t = torch.tensor(host, dtype=torch.int32, device=device)
    off_merge = n * 4 + 4
    return t, plan, off_merge, off_merge + 2


def single_decode_with_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                use_tensor_cores: bool = False, q_scale: Optional[float] = None,
                                k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                                window_left: int = -1, logits_soft_cap: Optional[float] = None,
                                sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
                                rope_theta: Optional[float] = None, return_lse: bool = False):
    """Decode attention of one request.

    Parameters
    ----------
    q : torch.Tensor
        ``[num_qo_heads, head_dim]``, float16 or bfloat16.
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND);
        float16, bfloat16, float8_e4m3fn or float8_e5m2.
    pos_encoding_mode : str
        ``"NONE"``, ``"ROPE_LLAMA"`` (q at position kv_len - 1, key j at j) or ``"ALIBI"``.
    q_scale, k_scale, v_scale : float, optional
        q_scale and k_scale multiply the softmax scale, v_scale the output.
    window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta
        As in shared/API.md (sm_scale defaults to 1/sqrt(head_dim)).
    return_lse : bool
        Also return the base-2 log-sum-exp ``[num_qo_heads]`` float32.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``o [num_qo_heads, head_dim]`` in q's dtype (and ``lse``).

    Examples
    --------
    >>> q = torch.randn(32, 128, dtype=torch.bfloat16, device="cuda")        # doctest: +SKIP
    >>> k = torch.randn(4096, 8, 128, dtype=torch.bfloat16, device="cuda")   # doctest: +SKIP
    >>> o = single_decode_with_kv_cache(q, k, k)                               # doctest: +SKIP
    """
    check_kv_layout(kv_layout)
    common.pos_mode(pos_encoding_mode)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dtype not in common.Q_DTYPES:
        raise InputTypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    if k.dtype not in common.KV_DTYPES or v.dtype != k.dtype:
        raise InputTypeError(f"k and v must share a dtype among float16, bfloat16, float8_e4m3fn, "
                             f"float8_e5m2, got {k.dtype} and {v.dtype}")
    checks.same_device(q=q, k=k, v=v)
    if q.dim() != 2 or k.dim() != 3 or v.shape != k.shape:
        raise InputError(f"expected q [Hq, D] and k, v [L, Hkv, D] ({kv_layout}) of equal shapes, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if kv_layout == "NHD":
        kv_len, hkv, d = k.shape
    else:
        hkv, kv_len, d = k.shape
    hq = q.shape[0]
    common.heads(hq, hkv)
    if q.shape[1] != d:
        raise InputError(f"q head_dim ({q.shape[1]}) must equal k's head_dim ({d})")
    if kv_len < 1 or d < 1:
        raise InputError(f"kv_len and head_dim must be >= 1, got {kv_len} and {d}")
    scale = common.softmax_scale(sm_scale, d) * common.scale_value("q_scale", q_scale)
    ks, vs = common.scale_value("k_scale", k_scale), common.scale_value("v_scale", v_scale)
    cap = common.soft_cap(logits_soft_cap)
    rs, rt = common.rope_options(rope_scale, rope_theta)
    wl = -1 if window_left is None else checks.int_value("window_left", window_left, -1)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(hq, dtype=torch.float32, device=q.device) if return_lse else None
    args = (out, lse, q, k, v, kv_layout, pos_encoding_mode, bool(use_tensor_cores), scale, ks, vs, wl,
            cap, rs, rt)
    if torch.compiler.is_compiling():
        torch.ops.fi_attention.single_decode(*args)
    else:
        _single_decode_core(*args)
    return (out, lse) if return_lse else out


def _single_decode_core(out, lse, q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, scale, ks, vs,
                        wl, cap, rs, rt) -> None:
    """Destination-passing core: writes o into out (and the base-2 LSE into lse if given)."""
    if kv_layout == "NHD":
        kv_len, hkv, d = k.shape
    else:
        hkv, kv_len, d = k.shape
    hq = q.shape[0]
    dev = q.device
    key = (dev, q.dtype, k.dtype, d, hq, hkv, kv_len, pos_encoding_mode, cap > 0, bool(use_tensor_cores))
    st = _STATE.get(key)
    if st is None:
        st = _STATE[key] = _single_state(key)
    backend, launch, template, plan, mod, _meta = st
    if backend != "cuda":
        for name, t in (("q", q), ("k", k), ("v", v)):  # the kernels' layout rule, on every device
            checks.last_dim_contiguous(name, t)
        kn, vn = (k, v) if kv_layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
        o, s = attention_reference(q[None], kn, vn, sm_scale=scale, logits_soft_cap=cap or None,
                                   window_left=wl, pos_encoding_mode=pos_encoding_mode,
                                   rope_scale=rs, rope_theta=rt, k_scale=ks, v_scale=vs,
                                   return_lse=True)
        out.copy_(o[0])
        if lse is not None:
            lse.copy_(s[0])
        return
    ks_, vs_, qs_ = k.stride(), v.stride(), q.stride()
    es = k.element_size()
    for name, t, st_ in (("k", k, ks_), ("v", v, vs_)):
        if st_[2] != 1 or t.data_ptr() % 16 or (st_[0] * es) % 16 or (st_[1] * es) % 16:
            raise InputError(f"{name} rows must be contiguous and 16-byte aligned, got strides {st_}")
    if qs_[1] != 1 or q.data_ptr() % 16 or qs_[0] % 8:
        raise InputError(f"q rows must be contiguous and 16-byte aligned, got strides {qs_}")
    # partial states only when the plan splits (a fresh allocation: stream-ordered, never shared)
    part = torch.empty(plan.num_slots * hq * (d + 1), dtype=torch.float32, device=dev) if plan.split else None
    tok_dim, head_dim_ = (0, 1) if kv_layout == "NHD" else (1, 0)
    # per-call copy of the signature's prebuilt block (a memcpy), then only the per-call fields
    a = DecodeArgs.from_buffer_copy(template)
    a.q, a.q_stride_h = q.data_ptr(), qs_[0]
    a.k, a.k_stride_tok, a.k_stride_head = k.data_ptr(), ks_[tok_dim], ks_[head_dim_]
    a.v, a.v_stride_tok, a.v_stride_head = v.data_ptr(), vs_[tok_dim], vs_[head_dim_]
    a.out, a.o_stride_h = out.data_ptr(), out.stride(0)
    if lse is not None:
        a.lse = lse.data_ptr()
    if part is not None:
        a.part_o = part.data_ptr()
        a.part_lse = a.part_o + plan.num_slots * hq * d * 4
    a.window_left = wl
    a.sm_scale, a.k_scale, a.v_scale, a.logits_soft_cap = scale, ks, vs, cap
    a.rope_scale, a.rope_theta = rs, rt
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    stream = raw_stream(idx)
    if part is not None and not capturing():  # a split merged in the grid (see _stream_counters)
        a.flags |= GRID_MERGE
        a.merge_count = _stream_counters(idx, stream, hq)
    a.stream, a.device = stream, idx  # the launcher makes idx current for its launch when it is not
    rc = launch(ctypes.addressof(a))
    if rc:
        raise mod.error(rc, "fi_batch_decode")


# Zeroed arrival counters of the in-grid merge (merge_in_grid, decode_common.cuh) per (device,
# stream): the kernel that merges a request puts its counters back to 0, and kernels of one stream
# run one after the other, so every call on a stream can use the same ones; calls on other streams
# may run at the same time and get their own. A call being captured into a CUDA graph launches the
# merge kernel instead: the graph may be replayed on any stream.
_COUNTERS: dict = {}


def _stream_counters(idx: int, stream: int, n: int) -> int:
    c = _COUNTERS.get((idx, stream))
    if c is None or c.numel() < n:
        c = _COUNTERS[(idx, stream)] = torch.zeros(max(n, 256), dtype=torch.int32, device=torch.device("cuda", idx))
    return c.data_ptr()


# Per call signature (device, dtypes, shapes, kv_len, options): backend, launch function, device
# metadata and plan. Everything here is a pure function of the key, so a repeated call does no
# dispatch, no spec hashing and no upload.
_STATE: dict = {}


def _single_state(key):
    dev, q_dtype, kv_dtype, d, hq, hkv, kv_len, pos, soft_cap, use_tc = key
    backend = common.SINGLE_DECODE.choose(dev, q_dtype, head_dim=d, kv_dtype=kv_dtype).name
    if backend != "cuda":
        return backend, None, None, None, None, None
    group = hq // hkv
    gh = heads_per_cta(group)
    mod = load(select_spec(q_dtype, kv_dtype, d, group, pos, soft_cap, arch_of(dev),
                           "tensor-core" if use_tc else "auto", small_mha_grid(hq, hkv, 1)))
    sm = device_info(dev.index if dev.index is not None else torch.cuda.current_device()).sm_count
    meta, plan, off_merge, off_tab = _single_meta(dev, kv_len, hkv * (group // gh), sm, _ctas_per_sm(mod))
    if len(_STATE) >= 1024:
        _STATE.clear()
    # The signature's fixed fields (metadata addresses, page geometry, grid). Zeroed pointers
    # (q_stride_b, *_stride_page, o_stride_b, lse, part) stay 0 unless a call sets them.
    t = DecodeArgs()
    base = meta.data_ptr()
    t.work, t.num_work, t.merge_indptr = base, base + plan.num_items * 16, base + off_merge * 4
    t.kv_indptr, t.kv_indices = base + off_tab * 4, base + (off_tab + 2) * 4
    t.kv_last_page_len = base + (off_tab + 3) * 4
    t.num_qo_heads, t.num_kv_heads = hq, hkv
    page = 1 << (kv_len - 1).bit_length()
    t.page_size, t.page_shift = page, page.bit_length() - 1
    t.grid_items, t.merge_batch = plan.num_items, (1 if plan.split else 0)
    # every table is in the signature's own metadata: read before the PDL wait (DecodeFlag)
    t.flags = TABLES_EARLY | INDICES_EARLY | PDL
    # the meta tensor rides along: _single_meta's LRU may drop it while this entry lives
    return backend, mod.fn("fi_batch_decode").raw, t, plan, mod, meta


@torch.library.custom_op("fi_attention::single_decode", mutates_args=("out", "lse"))
def _single_decode_op(out: torch.Tensor, lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, kv_layout: str, pos_encoding_mode: str, use_tensor_cores: bool,
                      scale: float, k_scale: float, v_scale: float, window_left: int, soft_cap: float,
                      rope_scale: float, rope_theta: float) -> None:
    _single_decode_core(out, lse, q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, scale,
                        k_scale, v_scale, window_left, soft_cap, rope_scale, rope_theta)


@_single_decode_op.register_fake
def _(out, lse, q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, scale, k_scale, v_scale,
      window_left, soft_cap, rope_scale, rope_theta) -> None:
    return None
