"""CPU tests of page management: formulas against loops, append on the CPU backend, validation."""

import pytest
import torch

from fi_core import testing
from fi_core.errors import InputError, InputTypeError
from fi_attention import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens


def test_get_seq_lens_matches_loop():
    indptr = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    last = torch.tensor([2, 1, 16, 7], dtype=torch.int32)
    want = [max(int(indptr[i + 1] - indptr[i]) - 1, 0) * 16 + int(last[i]) for i in range(4)]
    assert get_seq_lens(indptr, last, 16).tolist() == want


def test_batch_indices_positions_match_loop():
    append_indptr = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    seq_lens = torch.tensor([10, 4, 5, 1], dtype=torch.int32)
    b, p = get_batch_indices_positions(append_indptr, seq_lens, 9)
    wb, wp = [], []
    for r in range(4):
        n = int(append_indptr[r + 1] - append_indptr[r])
        for j in range(n):
            wb.append(r)
            wp.append(int(seq_lens[r]) - n + j)
    assert b.tolist() == wb and p.tolist() == wp
    assert b.dtype == torch.int32 and p.dtype == torch.int32


def _table(lens, ps, total_pages, seed=0):
    pages = [-(-n // ps) for n in lens]
    perm = torch.randperm(total_pages, generator=torch.Generator().manual_seed(seed))[: sum(pages)]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(lens, pages)], dtype=torch.int32)
    return perm.to(torch.int32), indptr, last


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_cpu_matches_loop(layout):
    ps, H, D = 4, 2, 8
    seq_lens = [6, 1, 9]
    appended = [2, 1, 5]
    indices, indptr, last = _table(seq_lens, ps, 12)
    shape = (12, 2, ps, H, D) if layout == "NHD" else (12, 2, H, ps, D)
    cache = testing.randn(shape, torch.float16, seed=3)
    before = cache.clone()
    append_indptr = torch.tensor([0, 2, 3, 8], dtype=torch.int32)
    nnz = 8
    key = testing.randn((nnz, H, D), torch.float16, seed=4)
    val = testing.randn((nnz, H, D), torch.float16, seed=5)
    b, p = get_batch_indices_positions(append_indptr, torch.tensor(seq_lens, dtype=torch.int32), nnz)
    append_paged_kv_cache(key, val, b, p, cache, indices, indptr, last, layout)
    expect = before.clone()
    for i in range(nnz):
        r, pos = int(b[i]), int(p[i])
        page = int(indices[int(indptr[r]) + pos // ps])
        for h in range(H):
            if layout == "NHD":
                expect[page, 0, pos % ps, h] = key[i, h]
                expect[page, 1, pos % ps, h] = val[i, h]
            else:
                expect[page, 0, h, pos % ps] = key[i, h]
                expect[page, 1, h, pos % ps] = val[i, h]
    assert torch.equal(cache, expect)
    assert sum(appended) == nnz


def test_append_validation():
    indices, indptr, last = _table([4], 4, 2)
    cache = torch.zeros(2, 2, 4, 2, 8, dtype=torch.float16)
    key = torch.zeros(1, 2, 8, dtype=torch.float16)
    bi = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(InputTypeError, match="dtype"):
        append_paged_kv_cache(key.float(), key, bi, bi, cache, indices, indptr, last)
    with pytest.raises(InputError, match=r"\[nnz, 2, 8\]"):
        append_paged_kv_cache(key[:, :1], key, bi, bi, cache, indices, indptr, last)
    with pytest.raises(InputTypeError, match="int32"):
        append_paged_kv_cache(key, key, bi.long(), bi, cache, indices, indptr, last)
    with pytest.raises(InputError, match="nnz"):
        append_paged_kv_cache(key, key, torch.zeros(2, dtype=torch.int32), bi, cache, indices, indptr, last)


def test_append_targets_are_checked():
    """Every appended token must land inside its request's pages (the table after the append):
    on the CPU always, on a GPU with FI_CHECK_INPUTS=1 (the checks read device values)."""
    indices, indptr, last = _table([6, 3], 4, 4)  # request 0: pages of 4 + 2 tokens, request 1: 3
    cache = torch.zeros(4, 2, 4, 2, 8, dtype=torch.float16)
    key = torch.ones(2, 2, 8, dtype=torch.float16)

    def append(bi, pos, ind=indices, ptr=indptr, lst=last):
        append_paged_kv_cache(key, key, torch.tensor(bi, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32),
                              cache, ind, ptr, lst)

    append([0, 1], [5, 2])  # the last slot of each request: fine
    with pytest.raises(InputError, match=r"token 0 of request 0 has position 6, its length is 6"):
        append([0, 1], [6, 0])
    with pytest.raises(InputError, match=r"token 1 of request 1 has position -1"):
        append([0, 1], [0, -1])
    with pytest.raises(InputError, match=r"batch_indices must be in \[0, 2\).*got \[0, 2\]"):
        append([0, 2], [0, 0])
    with pytest.raises(InputError, match=r"kv_indptr must start at 0, be non-decreasing and end <= len\(kv_indices\)=2"):
        append([0, 0], [0, 1], ind=indices[:2])
    with pytest.raises(InputError, match=r"kv_indptr must start at 0, be non-decreasing and end <= len\(kv_indices\)=3, "
                                         r"got \[0, 2, 1\]"):
        append([0, 0], [0, 1], ptr=torch.tensor([0, 2, 1], dtype=torch.int32))
    bad = indices.clone()
    bad[0] = 9
    with pytest.raises(InputError, match=r"page indices of appended tokens must be in \[0, 4\), got \[.*9\]"):
        append([0, 0], [0, 1], ind=bad)
    with pytest.raises(InputError, match=r"len\(kv_last_page_len\) \+ 1 = 2 entries, got 3"):
        append([0, 0], [0, 1], lst=last[:1])


def test_page_helpers_check_their_scalars_and_lengths():
    i32 = dict(dtype=torch.int32)
    for bad in (0, -16, 2.0, True):
        with pytest.raises(InputError, match="page_size must be an int >= 1"):
            get_seq_lens(torch.tensor([0, 2], **i32), torch.tensor([3], **i32), bad)
    ap, seq = torch.tensor([0, 3, 5], **i32), torch.tensor([10, 4], **i32)
    assert get_batch_indices_positions(ap, seq, 5)[1].tolist() == [7, 8, 9, 2, 3]
    with pytest.raises(InputError, match=r"nnz must equal append_indptr\[-1\] = 5, got 4"):
        get_batch_indices_positions(ap, seq, 4)
    with pytest.raises(InputError, match=r"nnz \(append_indptr\[-1\]\) must be an int >= 0, got 5.0"):
        get_batch_indices_positions(ap, seq, 5.0)
    with pytest.raises(InputError, match="request 0 appends 3 tokens to a length of 2"):
        get_batch_indices_positions(ap, torch.tensor([2, 4], **i32), 5)
    with pytest.raises(InputError, match="append_indptr must start at 0 and be non-decreasing"):
        get_batch_indices_positions(torch.tensor([0, 3, 2], **i32), seq, 2)


def test_last_page_len_is_checked_by_append_and_get_seq_lens():
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cache = torch.zeros(4, 2, 4, 2, 64, dtype=torch.float16)
    k = torch.ones(1, 2, 64, dtype=torch.float16)
    # request 0 owns one page of 4 slots: a last_page_len of 8 would let position 5 write into the
    # next page of the cache, another request's
    with pytest.raises(InputError, match=r"kv_last_page_len must be in \[1, page_size=4\]; request 0 has 8"):
        append_paged_kv_cache(k, k, i32([0]), i32([5]), cache, i32([0, 1, 2]), i32([0, 1, 3]), i32([8, 1]))
    assert cache.abs().sum() == 0
    with pytest.raises(InputError, match="kv_indptr must start at 0 and be non-decreasing"):
        get_seq_lens(i32([0, 3, 2]), i32([3, 4]), 4)
    with pytest.raises(InputError, match="request 0 has 0"):
        get_seq_lens(i32([0, 2, 5]), i32([0, 4]), 4)
    assert get_seq_lens(i32([0, 0, 2]), i32([0, 3]), 4).tolist() == [0, 7]  # no pages: any value
