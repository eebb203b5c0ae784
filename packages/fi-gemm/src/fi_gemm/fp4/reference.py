"""Pure-torch references for FP4 (e2m1) block-scaled data: decoding the packed codes and the
block scales in each scale-factor layout, dequantising, and ``mm_fp4`` in fp32.

Formats (FlashInfer's, from the TensorRT-LLM kernels it wraps):

- Codes: e2m1, two per byte along K, element ``2i`` in the low nibble and ``2i + 1`` in the high
  one; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign.
- NVFP4: one float8_e4m3fn scale per 16 consecutive K elements; MXFP4: one UE8M0 scale
  (``2 ** (byte - 127)``) per 32.
- Scale layouts over the logical [rows, K / block] scale matrix:
  ``"128x4"``: 512-byte tiles of 128 rows x 4 columns, tiles row-major over
  [ceil(rows / 128), ceil(cols / 4)]; inside a tile row ``r`` and column ``c`` sit at
  ``(r % 32) * 16 + (r % 128) // 32 * 4 + c % 4``. ``"8x4"``: 32-byte tiles of 8 x 4,
  ``(r % 8) * 4 + c % 4``. ``"linear"``: row-major [rows, cols]. Padding rows / columns of the
  swizzled layouts exist in memory and are never read.

The dequantised value ``code * scale`` is exact in bfloat16 (a 2-bit significand times a 4-bit
one fits its 8 bits), which the Hopper path relies on.
"""

from __future__ import annotations

from typing import Optional

import torch

LAYOUTS = ("128x4", "8x4", "linear")
# The kernels' layout codes (fp4.cuh: SfLayout).
LAYOUT_CODE = {name: i for i, name in enumerate(LAYOUTS)}
# |e2m1| by the low three bits of a code.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _ceil(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def sf_shape(rows: int, cols: int, layout: str) -> tuple[int, int]:
    """The padded [rows, cols] extent a scale layout stores for a logical [rows, cols] matrix."""
    if layout == "128x4":
        return _ceil(rows, 128), _ceil(cols, 4)
    if layout == "8x4":
        return _ceil(rows, 8), _ceil(cols, 4)
    return rows, cols


def sf_offsets(rows: int, cols: int, layout: str, device=None) -> torch.Tensor:
    """int64 [rows, cols]: the byte offset of each logical scale in its layout's storage."""
    r = torch.arange(rows, device=device).view(-1, 1)
    c = torch.arange(cols, device=device).view(1, -1)
    if layout == "linear":
        return r * cols + c
    k_tiles = sf_shape(rows, cols, layout)[1] // 4
    if layout == "128x4":
        return ((r // 128) * k_tiles + c // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4
    if layout == "8x4":
        return ((r // 8) * k_tiles + c // 4) * 32 + (r % 8) * 4 + c % 4
    raise ValueError(f"unknown scale layout {layout!r}; expected one of {LAYOUTS}")


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k / 2] -> float32 [..., k] (low nibble first)."""
    p = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)
    mag = torch.tensor(E2M1_MAGNITUDES, device=packed.device)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def decode_scales(raw: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """Scale bytes (uint8 or float8_e4m3fn) -> float32. UE8M0: 2 ** (byte - 127), 255 is NaN."""
    b = raw.contiguous().view(torch.uint8)
    if not ue8m0:
        return b.view(torch.float8_e4m3fn).float()
    e = b.to(torch.int32)
    val = torch.pow(2.0, (e - 127).to(torch.float64)).float()
    return torch.where(e == 255, torch.full_like(val, float("nan")), val)


def logical_scales(sf: torch.Tensor, rows: int, cols: int, layout: str, ue8m0: bool) -> torch.Tensor:
    """float32 [rows, cols] scales read from ``sf``'s storage (its bytes in memory order)."""
    flat = decode_scales(sf.reshape(-1), ue8m0)
    return flat[sf_offsets(rows, cols, layout, sf.device)]


def dequantize_fp4(packed: torch.Tensor, sf: torch.Tensor, block_size: int, ue8m0: bool,
                   layout: str) -> torch.Tensor:
    """packed uint8 [rows, k / 2] and its block scales -> float32 [rows, k] = code * scale."""
    rows, half = packed.shape
    k = 2 * half
    s = logical_scales(sf, rows, k // block_size, layout, ue8m0)
    return unpack_e2m1(packed) * s.repeat_interleave(block_size, dim=1)


def mm_fp4_reference(a: torch.Tensor, w: torch.Tensor, a_sf: torch.Tensor, w_sf: torch.Tensor,
                     alpha: Optional[torch.Tensor], out_dtype: torch.dtype, block_size: int,
                     ue8m0: bool, a_layout: str = "128x4") -> torch.Tensor:
    """``(deq(a) @ deq(w)^T) * alpha`` in fp32, rounded once to ``out_dtype``.

    a: uint8 [m, k / 2]; w: uint8 [n, k / 2] (the row-major weight, i.e. FlashInfer's ``b.T``);
    a_sf in ``a_layout``, w_sf in "128x4"; alpha a one-element float32 tensor or None (1).
    """
    af = dequantize_fp4(a, a_sf, block_size, ue8m0, a_layout)
    wf = dequantize_fp4(w, w_sf, block_size, ue8m0, "128x4")
    acc = af @ wf.T
    if alpha is not None:
        acc = acc * alpha.float().reshape(())
    return acc.to(out_dtype)
