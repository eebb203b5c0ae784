"""References for block-scaled FP8 GEMM: dequantise with the DeepSeek-style scales (1 x 128 for
activations, 128 x 128 for weights), multiply in fp32, round once."""

from __future__ import annotations

import torch


def expand_scales(scales: torch.Tensor, rows: int, cols: int, block_rows: int,
                  block_cols: int) -> torch.Tensor:
    """[ceil(rows / br), ceil(cols / bc)] block scales -> [rows, cols] elementwise scales."""
    s = scales.float().repeat_interleave(block_rows, dim=0)[:rows]
    return s.repeat_interleave(block_cols, dim=1)[:, :cols]


def groupwise_reference(a: torch.Tensor, b: torch.Tensor, a_scale_mk: torch.Tensor,
                        b_scale_nk: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [m, k] fp8 with a_scale_mk [m, ceil(k/128)]; b [n, k] fp8 with b_scale_nk
    [ceil(n/128), ceil(k/128)]. Returns (a * sa) @ (b * sb)^T in fp32, cast to out_dtype."""
    m, k = a.shape
    n = b.shape[0]
    af = a.float() * expand_scales(a_scale_mk, m, k, 1, 128)
    bf = b.float() * expand_scales(b_scale_nk, n, k, 128, 128)
    return (af @ bf.T).to(out_dtype)
