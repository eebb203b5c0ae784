"""GPU tests of append_paged_kv_cache against the CPU implementation (exact copies)."""

import pytest
import torch

from fi_core import testing
from fi_attention import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens

pytestmark = testing.gpu_only()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tuple_cache", [False, True])
def test_append_matches_cpu(dtype, layout, page_size, tuple_cache):
    H, D = 8, 128
    old = [0, 37, 5, 100]
    add = [7, 1, 30, 1]
    new = [o + a for o, a in zip(old, add)]
    pages = [-(-n // page_size) for n in new]
    total = sum(pages) + 3
    indices = torch.randperm(total, generator=torch.Generator().manual_seed(1))[: sum(pages)].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(new, pages)], dtype=torch.int32)
    shape = (total, 2, page_size, H, D) if layout == "NHD" else (total, 2, H, page_size, D)
    cache = testing.randn(shape, torch.float32, seed=2).to(dtype)
    nnz = sum(add)
    key = testing.randn((nnz, H, D), torch.float32, seed=3).to(dtype)
    val = testing.randn((nnz, H, D), torch.float32, seed=4).to(dtype)
    append_indptr = torch.tensor([0] + torch.tensor(add).cumsum(0).tolist(), dtype=torch.int32)
    seq = get_seq_lens(indptr, last, page_size)
    assert seq.tolist() == new

    def run(device):
        c = cache.to(device)
        cc = (c[:, 0].clone(), c[:, 1].clone()) if tuple_cache else c
        b, p = get_batch_indices_positions(append_indptr.to(device), seq.to(device), nnz)
        append_paged_kv_cache(key.to(device), val.to(device), b, p, cc, indices.to(device),
                              indptr.to(device), last.to(device), layout)
        res = torch.stack(cc, 1) if tuple_cache else cc
        return res.cpu().view(torch.uint8)

    assert torch.equal(run("cuda"), run("cpu"))
