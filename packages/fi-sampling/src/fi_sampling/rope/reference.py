"""Pure-torch RoPE reference: the CPU backend, the test oracle and the benchmark's check.

Rounding mirrors the kernel where it matters for large positions: each pair frequency is computed
in float64 and rounded once to float32, the angle is the float32 product ``float(pos) * freq``
(bit-identical to the kernel), and sin/cos of that angle are evaluated in float64. The rotation
itself is done in float32 and rounded once to the input dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def llama31_smoothing(low_freq_factor: float, high_freq_factor: float,
                      old_context_len: float) -> tuple[float, float]:
    """(a, b) of the Llama 3.1 blend ``s = clamp(a * freq + b, 0, 1)``.

    With ``wavelen = 2 pi / freq``, Llama 3.1 keeps ``freq`` where ``wavelen < old_context_len /
    high_freq_factor`` (s = 1), uses ``freq / rope_scale`` where ``wavelen > old_context_len /
    low_freq_factor`` (s = 0) and blends ``(1 - s) * freq / rope_scale + s * freq`` in between,
    with ``s = (old_context_len / wavelen - low) / (high - low)``, which is linear in freq.
    """
    a = old_context_len / (2 * math.pi * high_freq_factor - 2 * math.pi * low_freq_factor)
    b = -1.0 / (high_freq_factor / low_freq_factor - 1.0)
    return a, b


def rope_frequencies(rotary_dim: int, rope_scale: float = 1.0, rope_theta: float = 1e4,
                     llama31: Optional[tuple[float, float, float]] = None,
                     device="cpu") -> torch.Tensor:
    """Frequency of each rotation pair, float32 ``[rotary_dim // 2]``.

    ``freq_i = theta^(-2i / rotary_dim) / rope_scale``; with ``llama31 = (low_freq_factor,
    high_freq_factor, old_context_len)`` the Llama 3.1 blend of the scaled and unscaled frequency.
    """
    half = rotary_dim // 2
    i = torch.arange(half, dtype=torch.float64, device=device)
    f = torch.pow(torch.tensor(float(rope_theta), dtype=torch.float64, device=device),
                  (-2.0 * i) / float(2 * half))
    scaled = f * (1.0 / float(rope_scale))
    if llama31 is None:
        return scaled.float()
    a, b = llama31_smoothing(*llama31)
    s = (f * a + b).clamp(0.0, 1.0)
    return ((1.0 - s) * scaled + s * f).float()


def cos_sin_from_positions(pos: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 ``[nnz, half]`` of the angles ``float32(pos) * freqs`` (float32 product)."""
    angle = pos.to(torch.float32)[:, None] * freqs.to(pos.device)[None, :]
    angle = angle.double()
    return torch.cos(angle).float(), torch.sin(angle).float()


def cos_sin_from_cache(pos: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 ``[nnz, half]`` from a ``[max_pos, rotary_dim]`` cache (cos | sin).
    Positions outside ``[0, max_pos)`` give NaN rows, as in the kernel."""
    half = cos_sin_cache.shape[1] // 2
    pos = pos.long()
    valid = (pos >= 0) & (pos < cos_sin_cache.shape[0])
    rows = cos_sin_cache.float()[pos.clamp(0, max(cos_sin_cache.shape[0] - 1, 0))]
    rows = torch.where(valid[:, None], rows, torch.full_like(rows, float("nan")))
    return rows[:, :half], rows[:, half:]


def positions_from_indptr(indptr: torch.Tensor, offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """int64 ``[nnz]``: token j of request i (``indptr[i] <= j < indptr[i+1]``) is at position
    ``offsets[i] + j - indptr[i]``."""
    ind = indptr.long()
    t = torch.arange(nnz, dtype=torch.int64, device=indptr.device)
    # request of each token: the last i with indptr[i] <= t (skips empty requests)
    req = torch.searchsorted(ind[:-1].contiguous(), t, right=True) - 1
    req = req.clamp(min=0)
    return offsets.long()[req] + t - ind[req]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of x ``[nnz, H, D]`` (any float dtype) by
    per-token angles; cos/sin ``[nnz, half]``. Returns a new tensor of x's dtype; the tail past
    the rotary dims is copied unchanged."""
    half = cos.shape[-1]
    rd = 2 * half
    xf = x.float()
    c = cos[:, None, :].float()
    s = sin[:, None, :].float()
    if interleave:
        x1, x2 = xf[..., 0:rd:2], xf[..., 1:rd:2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:rd]
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    out = xf.clone()
    if interleave:
        out[..., 0:rd:2] = y1
        out[..., 1:rd:2] = y2
    else:
        out[..., :half] = y1
        out[..., half:rd] = y2
    return out.to(x.dtype)


def rope_reference(q: torch.Tensor, k: torch.Tensor, *, pos_ids: Optional[torch.Tensor] = None,
                   indptr: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None,
                   cos_sin_cache: Optional[torch.Tensor] = None, rotary_dim: Optional[int] = None,
                   interleave: bool = False, rope_scale: float = 1.0, rope_theta: float = 1e4,
                   llama31: Optional[tuple[float, float, float]] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The one RoPE reference for every variant.

    q ``[nnz, H_q, D]``, k ``[nnz, H_k, D]``; positions from ``pos_ids`` ``[nnz]`` or from
    ``indptr`` ``[B+1]`` + ``offsets`` ``[B]``; angles from ``cos_sin_cache`` ``[max_pos,
    rotary_dim]`` (then rotary_dim is its width) or computed from rope_scale/rope_theta
    (/llama31). Returns new (q_rope, k_rope) of the inputs' dtype.
    """
    nnz = q.shape[0]
    if pos_ids is None:
        pos_ids = positions_from_indptr(indptr, offsets, nnz)
    if cos_sin_cache is not None:
        cos, sin = cos_sin_from_cache(pos_ids, cos_sin_cache)
    else:
        rd = q.shape[-1] if rotary_dim is None else rotary_dim
        freqs = rope_frequencies(rd, rope_scale, rope_theta, llama31, device=q.device)
        cos, sin = cos_sin_from_positions(pos_ids.to(q.device), freqs)
    return rotate(q, cos, sin, interleave), rotate(k, cos, sin, interleave)
