"""CPU tests of fi_core.launch's call memo (the fast paths of fi_gemm's ops keep their recorded
call signatures in it)."""

from fi_core.launch import CallMemo


def test_call_memo_is_a_dict_that_forgets_everything_at_its_limit():
    memo = CallMemo(limit=3)
    assert not memo and memo.get(("a",)) is None
    for i in range(3):
        memo.put((i,), f"v{i}")
    assert len(memo) == 3 and memo.get((1,)) == "v1"
    memo.put((1,), "again")  # a held signature is replaced in place, even when full
    assert dict(memo) == {(0,): "v0", (1,): "again", (2,): "v2"}
    memo.put((9,), "v9")  # a new one when full: the memo starts over
    assert dict(memo) == {(9,): "v9"}
    memo.clear()
    assert len(memo) == 0 and memo.limit == 3


def test_call_memo_default_limit():
    assert CallMemo().limit == 1024
