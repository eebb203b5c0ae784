"""RoPE: validate -> choose backend -> launch, behind FlashInfer's ``flashinfer.rope`` names.

Every public function funnels into one destination-passing core, ``_rope_dispatch(q, k, q_out,
k_out, ...)``, which runs the CUDA kernel (``rope.cu``) or the pure-torch reference. Two torch
custom ops wrap it for ``torch.compile``: ``fi_sampling::rope`` (writes q_out/k_out) and
``fi_sampling::rope_inplace`` (mutates q/k).
"""

from __future__ import annotations

from typing import Optional

import torch

from fi_core import Backend, OpInfo, arch_of, checks, current_stream, knobs, load, on_device, register_op
from fi_core.errors import InputError, InputTypeError

from .reference import llama31_smoothing, rope_reference
from .spec import SUPPORTED_DTYPES, rope_spec

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)

_BACKENDS = (
    Backend("cuda", min_arch="8.0", dtypes=SUPPORTED_DTYPES,
            notes="one pass over q and k, 16-byte accesses; fp32 angles, fp64 range reduction"),
    Backend("reference", devices=("cpu", "cuda"), notes="pure torch, fp32 math"),
)

_PUBLIC = (
    "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids", "apply_rope_pos_ids_inplace",
    "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
)
OPS = {name: register_op(OpInfo(
    name=name, family="fi-sampling", api=f"flashinfer.rope.{name}", backends=_BACKENDS,
    specs=lambda arch: [rope_spec(torch.bfloat16, arch), rope_spec(torch.float16, arch)],
)) for name in _PUBLIC}

_CHOICE: dict = {}


# ---- validation ---------------------------------------------------------------------------------

def _check_qk(q, k, ndim: int = 3) -> None:
    checks.dtype("q", q, _FLOAT_DTYPES)
    checks.dtype("k", k, _FLOAT_DTYPES)
    if k.dtype != q.dtype:
        raise InputTypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    checks.ndim("q", q, (ndim,))
    checks.ndim("k", k, (ndim,))
    if k.shape[0] != q.shape[0]:
        raise InputError(f"q and k must have the same number of tokens, got {q.shape[0]} and {k.shape[0]}")
    checks.last_dim_contiguous("q", q)
    checks.last_dim_contiguous("k", k)
    checks.same_device(q=q, k=k)


def _check_index(name: str, t, length: Optional[int], device) -> None:
    checks.dtype(name, t, _INDEX_DTYPES)
    checks.ndim(name, t, (1,))
    if length is not None and t.shape[0] != length:
        raise InputError(f"{name} must have shape [{length}], got {tuple(t.shape)}")
    if t.device != device:
        raise InputError(f"{name} must be on {device} with q/k, got {t.device}")


def _rotary_dim(rotary_dim, head_dim: int) -> int:
    rd = head_dim if rotary_dim is None else rotary_dim
    if not isinstance(rd, int) or isinstance(rd, bool):
        raise InputTypeError(f"rotary_dim must be an int or None, got {type(rotary_dim).__name__}")
    if rd <= 0 or rd % 2 != 0 or rd > head_dim:
        raise InputError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rd}")
    return rd


def _check_scalars(rope_scale, rope_theta, llama31=None) -> None:
    if not rope_scale > 0:
        raise InputError(f"rope_scale must be > 0, got {rope_scale!r}")
    if not rope_theta > 0:
        raise InputError(f"rope_theta must be > 0, got {rope_theta!r}")
    if llama31 is not None:
        low, high, old = llama31
        if not (0 < low < high):
            raise InputError(f"need 0 < low_freq_factor < high_freq_factor, got {low!r} and {high!r}")
        if not old > 0:
            raise InputError(f"old_context_len must be > 0, got {old!r}")


def _check_ragged(q, indptr, offsets) -> None:
    _check_index("indptr", indptr, None, q.device)
    if indptr.shape[0] < 2:
        raise InputError(f"indptr must have shape [batch_size + 1] with batch_size >= 1, got {tuple(indptr.shape)}")
    _check_index("offsets", offsets, indptr.shape[0] - 1, q.device)
    if knobs.check_inputs():  # reads device data: synchronises
        checks.indptr_values("indptr", indptr, q.shape[0], exact=True, end_name="nnz")


# ---- the destination-passing core ---------------------------------------------------------------

def _as_heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    return t if head_size == 0 else t.view(t.shape[0], t.shape[1] // head_size, head_size)


def _strides(t: torch.Tensor) -> tuple[int, int]:
    # A size-1 dim's stride is never used in an address; 0 keeps it out of the alignment choice.
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0)


def _backend(device: torch.device, dtype: torch.dtype) -> str:
    key = (device, dtype)
    name = _CHOICE.get(key)
    if name is None:
        name = _CHOICE[key] = OPS["apply_rope"].choose(device=device, dtype=dtype).name
    return name


def _rope_dispatch(q, k, q_out, k_out, pos_ids, indptr, offsets, cos_sin_cache, head_size: int,
                   rotary_dim: int, interleave: bool, rope_scale: float, rope_theta: float,
                   llama31: bool, low_freq_factor: float, high_freq_factor: float,
                   old_context_len: float) -> None:
    q, k = _as_heads(q, head_size), _as_heads(k, head_size)
    q_out, k_out = _as_heads(q_out, head_size), _as_heads(k_out, head_size)
    nnz = q.shape[0]
    if nnz == 0:
        return
    smoothing = (low_freq_factor, high_freq_factor, old_context_len) if llama31 else None
    if _backend(q.device, q.dtype) == "reference":
        qr, kr = rope_reference(q, k, pos_ids=pos_ids, indptr=indptr, offsets=offsets,
                                cos_sin_cache=cos_sin_cache, rotary_dim=rotary_dim,
                                interleave=interleave, rope_scale=rope_scale,
                                rope_theta=rope_theta, llama31=smoothing)
        q_out.copy_(qr)
        k_out.copy_(kr)
        return
    smooth_a, smooth_b = llama31_smoothing(*smoothing) if llama31 else (0.0, 0.0)
    pos = pos_ids if pos_ids is not None else offsets
    mod = load(rope_spec(q.dtype, arch_of(q.device)))
    with on_device(q.device):
        mod.fi_rope(
            q_out.data_ptr(), k_out.data_ptr(), q.data_ptr(), k.data_ptr(), nnz, q.shape[1],
            k.shape[1], q.shape[2], rotary_dim, *_strides(q), *_strides(k), *_strides(q_out),
            *_strides(k_out), pos.data_ptr(), int(pos.dtype == torch.int64),
            None if indptr is None else indptr.data_ptr(),
            int(indptr is not None and indptr.dtype == torch.int64),
            0 if indptr is None else indptr.shape[0] - 1,
            None if cos_sin_cache is None else cos_sin_cache.data_ptr(),
            0 if cos_sin_cache is None else cos_sin_cache.shape[0], int(interleave),
            float(rope_theta), 1.0 / float(rope_scale), int(llama31), smooth_a, smooth_b,
            current_stream(q.device))


@torch.library.custom_op("fi_sampling::rope", mutates_args=("q_out", "k_out"))
def _rope_op(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
             pos_ids: Optional[torch.Tensor], indptr: Optional[torch.Tensor],
             offsets: Optional[torch.Tensor], cos_sin_cache: Optional[torch.Tensor],
             head_size: int, rotary_dim: int, interleave: bool, rope_scale: float,
             rope_theta: float, llama31: bool, low_freq_factor: float, high_freq_factor: float,
             old_context_len: float) -> None:
    _rope_dispatch(q, k, q_out, k_out, pos_ids, indptr, offsets, cos_sin_cache, head_size,
                   rotary_dim, interleave, rope_scale, rope_theta, llama31, low_freq_factor,
                   high_freq_factor, old_context_len)


@_rope_op.register_fake
def _(q, k, q_out, k_out, pos_ids, indptr, offsets, cos_sin_cache, head_size, rotary_dim,
      interleave, rope_scale, rope_theta, llama31, low_freq_factor, high_freq_factor,
      old_context_len) -> None:
    return None


@torch.library.custom_op("fi_sampling::rope_inplace", mutates_args=("q", "k"))
def _rope_inplace_op(q: torch.Tensor, k: torch.Tensor, pos_ids: Optional[torch.Tensor],
                     indptr: Optional[torch.Tensor], offsets: Optional[torch.Tensor],
                     cos_sin_cache: Optional[torch.Tensor], head_size: int, rotary_dim: int,
                     interleave: bool, rope_scale: float, rope_theta: float, llama31: bool,
                     low_freq_factor: float, high_freq_factor: float,
                     old_context_len: float) -> None:
    _rope_dispatch(q, k, q, k, pos_ids, indptr, offsets, cos_sin_cache, head_size, rotary_dim,
                   interleave, rope_scale, rope_theta, llama31, low_freq_factor,
                   high_freq_factor, old_context_len)


@_rope_inplace_op.register_fake
def _(q, k, pos_ids, indptr, offsets, cos_sin_cache, head_size, rotary_dim, interleave,
      rope_scale, rope_theta, llama31, low_freq_factor, high_freq_factor, old_context_len) -> None:
    return None


def _run(q, k, inplace: bool, pos_ids=None, indptr=None, offsets=None, cos_sin_cache=None,
         head_size: int = 0, rotary_dim: int = 0, interleave: bool = False,
         rope_scale: float = 1.0, rope_theta: float = 1e4, llama31=None):
    low, high, old = llama31 if llama31 is not None else (1.0, 4.0, 8192.0)
    args = (pos_ids, indptr, offsets, cos_sin_cache, head_size, int(rotary_dim), bool(interleave),
            float(rope_scale), float(rope_theta), llama31 is not None, float(low), float(high),
            float(old))
    compiling = torch.compiler.is_compiling()
    if inplace:
        if compiling:
            torch.ops.fi_sampling.rope_inplace(q, k, *args)
        else:
            _rope_dispatch(q, k, q, k, *args)
        return None
    # FlashInfer allocates with empty_like: outputs keep the inputs' layout when it is dense.
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if compiling:
        torch.ops.fi_sampling.rope(q, k, q_out, k_out, *args)
    else:
        _rope_dispatch(q, k, q_out, k_out, *args)
    return q_out, k_out


def _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, inplace,
            llama31=None):
    _check_qk(q, k)
    if k.shape[2] != q.shape[2]:
        raise InputError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    rd = _rotary_dim(rotary_dim, q.shape[2])
    _check_scalars(rope_scale, rope_theta, llama31)
    _check_ragged(q, indptr, offsets)
    return _run(q, k, inplace, indptr=indptr, offsets=offsets, rotary_dim=rd,
                interleave=interleave, rope_scale=rope_scale, rope_theta=rope_theta,
                llama31=llama31)


def _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, inplace, llama31=None):
    _check_qk(q, k)
    if k.shape[2] != q.shape[2]:
        raise InputError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    rd = _rotary_dim(rotary_dim, q.shape[2])
    _check_scalars(rope_scale, rope_theta, llama31)
    _check_index("pos_ids", pos_ids, q.shape[0], q.device)
    return _run(q, k, inplace, pos_ids=pos_ids, rotary_dim=rd, interleave=interleave,
                rope_scale=rope_scale, rope_theta=rope_theta, llama31=llama31)


def _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, inplace):
    checks.ndim("query", query, (2, 3))
    _check_qk(query, key, ndim=query.dim())
    if not isinstance(head_size, int) or head_size <= 0:
        raise InputError(f"head_size must be a positive int, got {head_size!r}")
    for name, t in (("query", query), ("key", key)):
        ok = (t.shape[2] == head_size if t.dim() == 3
              else t.shape[1] > 0 and t.shape[1] % head_size == 0)
        if not ok:
            raise InputError(f"{name} must have shape [nnz, num_heads * head_size={head_size}] "
                             f"(or [nnz, num_heads, head_size]), got {tuple(t.shape)}")
    _check_index("positions", positions, query.shape[0], query.device)
    checks.dtype("cos_sin_cache", cos_sin_cache, (torch.float32,))
    checks.ndim("cos_sin_cache", cos_sin_cache, (2,))
    checks.contiguous("cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.device != query.device:
        raise InputError(f"cos_sin_cache must be on {query.device}, got {cos_sin_cache.device}")
    rd = cos_sin_cache.shape[1]
    if rd <= 0 or rd % 2 != 0 or rd > head_size:
        raise InputError(f"cos_sin_cache must have shape [max_pos, rotary_dim] with rotary_dim even "
                         f"and <= head_size={head_size}, got {tuple(cos_sin_cache.shape)}")
    if knobs.check_inputs():
        checks.index_values("positions", positions, cos_sin_cache.shape[0])
    return _run(query, key, inplace, pos_ids=positions, cos_sin_cache=cos_sin_cache,
                head_size=head_size if query.dim() == 2 else 0, rotary_dim=rd,
                interleave=not is_neox)



# ---- public API (flashinfer.rope) ----------------------------------------------------------------
_SHARED_DOC = """
    q : torch.Tensor
        Queries ``[nnz, num_q_heads, head_dim]``, float16 or bfloat16 (float32 runs the
        reference); any strides with a contiguous last dim (e.g. a slice of a fused qkv).
    k : torch.Tensor
        Keys ``[nnz, num_k_heads, head_dim]``, same dtype and device as q.
    rotary_dim : int, optional
        Rotate the first ``rotary_dim`` features (even, <= head_dim); the rest pass through
        unchanged. Default: head_dim.
    interleave : bool
        False (NeoX): rotate pairs ``(x[i], x[i + rotary_dim/2])``. True (GPT-J): rotate
        ``(x[2i], x[2i+1])``.
    rope_scale, rope_theta : float
        Pair i turns by ``pos * theta^(-2i/rotary_dim) / rope_scale`` (fp32 angle)."""


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1,
               rope_theta=1e4):
    """Apply RoPE to ragged q/k; returns new ``(q_rope, k_rope)`` of q's dtype and shapes.

    Token j of request i (``indptr[i] <= j < indptr[i+1]``) is at position
    ``offsets[i] + j - indptr[i]``.

    Parameters
    ----------%s
    indptr : torch.Tensor
        ``[batch_size + 1]`` int32/int64, ``indptr[0] == 0``, ``indptr[-1] == nnz``.
    offsets : torch.Tensor
        ``[batch_size]`` int32/int64 position of each request's first token.

    Examples
    --------
    >>> q = torch.randn(5, 4, 64, dtype=torch.bfloat16)
    >>> k = torch.randn(5, 1, 64, dtype=torch.bfloat16)
    >>> indptr, offsets = torch.tensor([0, 2, 5]), torch.tensor([10, 0])
    >>> q_rope, k_rope = apply_rope(q, k, indptr, offsets)
    >>> q_rope.shape, k_rope.dtype
    (torch.Size([5, 4, 64]), torch.bfloat16)

    See Also
    --------
    apply_rope_inplace, apply_rope_pos_ids, apply_llama31_rope
    """
    return _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, False)


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1,
                       rope_theta=1e4) -> None:
    """In-place :func:`apply_rope`: rotates q and k where they are and returns None.
    Features past ``rotary_dim`` are not touched."""
    _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, True)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1,
                       rope_theta=1e4):
    """Apply RoPE with one position per token; returns new ``(q_rope, k_rope)``.

    Parameters
    ----------%s
    pos_ids : torch.Tensor
        ``[nnz]`` int32/int64 position of each token (exact up to 2^24).

    Examples
    --------
    >>> q = torch.randn(3, 8, 128, dtype=torch.float16)
    >>> k = torch.randn(3, 2, 128, dtype=torch.float16)
    >>> q_rope, k_rope = apply_rope_pos_ids(q, k, torch.tensor([0, 7, 4096]))
    >>> q_rope.shape
    torch.Size([3, 8, 128])

    See Also
    --------
    apply_rope_pos_ids_inplace, apply_rope_with_cos_sin_cache
    """
    return _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, False)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1,
                               rope_theta=1e4) -> None:
    """In-place :func:`apply_rope_pos_ids`; returns None."""
    _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, True)


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8,
                       rope_theta=5e5, low_freq_factor=1, high_freq_factor=4,
                       old_context_len=8192):
    """:func:`apply_rope` with Llama 3.1 frequency smoothing; returns new ``(q_rope, k_rope)``.

    With ``f = theta^(-2i/rotary_dim)`` and ``s = clamp(old_context_len * f / (2 pi (high - low))
    - low / (high - low), 0, 1)`` the frequency is ``(1 - s) * f / rope_scale + s * f``: long
    wavelengths are scaled, short ones kept, the band between blended.

    Examples
    --------
    >>> q = torch.randn(4, 8, 128, dtype=torch.bfloat16)
    >>> k = torch.randn(4, 8, 128, dtype=torch.bfloat16)
    >>> q_rope, _ = apply_llama31_rope(q, k, torch.tensor([0, 4]), torch.tensor([100]))
    >>> q_rope.shape
    torch.Size([4, 8, 128])

    See Also
    --------
    apply_llama31_rope_pos_ids, apply_rope
    """
    return _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, False,
                   (float(low_freq_factor), float(high_freq_factor), float(old_context_len)))


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False,
                               rope_scale=8, rope_theta=5e5, low_freq_factor=1,
                               high_freq_factor=4, old_context_len=8192) -> None:
    """In-place :func:`apply_llama31_rope`; returns None."""
    _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, True,
            (float(low_freq_factor), float(high_freq_factor), float(old_context_len)))


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8,
                               rope_theta=5e5, low_freq_factor=1, high_freq_factor=4,
                               old_context_len=8192):
    """:func:`apply_rope_pos_ids` with Llama 3.1 smoothing (see :func:`apply_llama31_rope`)."""
    return _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, False,
                    (float(low_freq_factor), float(high_freq_factor), float(old_context_len)))


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False,
                                       rope_scale=8, rope_theta=5e5, low_freq_factor=1,
                                       high_freq_factor=4, old_context_len=8192) -> None:
    """In-place :func:`apply_llama31_rope_pos_ids`; returns None."""
    _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, True,
             (float(low_freq_factor), float(high_freq_factor), float(old_context_len)))


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """RoPE from a precomputed cos/sin cache (vLLM/SGLang layout); returns new ``(query, key)``.

    Parameters
    ----------
    positions : torch.Tensor
        ``[nnz]`` int32/int64 row of the cache for each token; rows outside
        ``[0, max_pos)`` give NaN on the GPU (``FI_CHECK_INPUTS=1`` raises instead).
    query, key : torch.Tensor
        ``[nnz, num_heads * head_size]`` float16/bfloat16, contiguous last dim (row stride free);
        ``[nnz, num_heads, head_size]`` is accepted too. Outputs keep the input's shape.
    head_size : int
    cos_sin_cache : torch.Tensor
        ``[max_pos, rotary_dim]`` float32, contiguous: cos in the first half, sin in the second.
        Features past rotary_dim pass through unchanged.
    is_neox : bool
        True: rotate halves; False: rotate even/odd pairs (cache column i/2 for pair i).

    Examples
    --------
    >>> cache = torch.randn(32, 64)
    >>> q, k = torch.randn(3, 4 * 64), torch.randn(3, 64)
    >>> q2, k2 = apply_rope_with_cos_sin_cache(torch.tensor([0, 5, 31]), q, k, 64, cache)
    >>> q2.shape
    torch.Size([3, 256])

    See Also
    --------
    apply_rope_with_cos_sin_cache_inplace, apply_rope_pos_ids
    """
    return _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, False)


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                          is_neox=True) -> None:
    """In-place :func:`apply_rope_with_cos_sin_cache`; returns None."""
    _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, True)


apply_rope.__doc__ %= _SHARED_DOC
apply_rope_pos_ids.__doc__ %= _SHARED_DOC
