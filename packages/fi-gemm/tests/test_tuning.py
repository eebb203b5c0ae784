"""CPU tests of the GEMM autotuner's bookkeeping (fi_gemm.tuning): choosing among timed
candidates, the records file (round trip, other versions and devices, damaged files, unknown unit
names, the FI_GEMM_TUNING knob) and the autotune() context. The timing and the dispatch run on
the GPU (tests/dense/test_dense_gpu.py::test_autotune_*)."""

import json

import pytest
import torch

from fi_core import knobs
from fi_gemm import autotune, tuning
from fi_gemm.dense import api
from fi_gemm.version import __version__

DEV = "NVIDIA H200"
KEY = tuning.problem_key("bmm_fp8", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16,
                         320, 1088, 1152, 1)
KEY16 = tuning.problem_key("mm_bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16,
                           4096, 4096, 4096, 1)


@pytest.fixture(autouse=True)
def _cache(tmp_path):
    with knobs.override(FI_CACHE_DIR=str(tmp_path / "cache")):
        tuning.forget()
        yield tmp_path / "cache"
        tuning.forget()


def _load(index=0, name=DEV):
    return tuning.load(index, name, "9.0a", api._valid_record)


def test_fastest_picks_the_smallest_time_and_skips_units_that_cannot_run():
    times = {"large": 10.0, "mid": 7.5, "t128x128_c2x1": None}
    best, got = tuning.fastest(list(times), times.get)
    assert best == "mid" and got == {"large": 10.0, "mid": 7.5}
    best, _ = tuning.fastest(["a", "b"], {"a": 3.0, "b": 3.0}.get)
    assert best == "a"  # ties: the table's order
    with pytest.raises(ValueError, match="no candidate"):
        tuning.fastest(["a"], lambda c: None)


def test_records_round_trip_through_the_cache_file(_cache):
    assert _load() == {}
    with autotune():
        tuning.record(0, KEY, "t128x128_c2x1", {"large": 12.0, "t128x128_c2x1": 11.5})
        tuning.record(0, KEY16, "mid", {"large": 210.0, "mid": 205.0})
    data = json.loads((_cache / "tuning" / "NVIDIA_H200.json").read_text())
    assert data["fi_gemm"] == __version__ and data["device"] == DEV and data["arch"] == "9.0a"
    entry = data["entries"]["bmm_fp8|float8_e4m3fn|float8_e4m3fn|bfloat16|320|1088|1152|1"]
    assert entry["config"] == "t128x128_c2x1" and entry["us"]["large"] == 12.0
    tuning.forget()  # a new process: the records come back from the file
    assert _load() == {KEY: "t128x128_c2x1", KEY16: "mid"}


def test_persist_false_keeps_the_records_in_memory_only(_cache):
    _load()
    with autotune(persist=False):
        tuning.record(0, KEY, "large", {"large": 1.0})
    assert tuning.RECORDS[0] == {KEY: "large"}
    assert not (_cache / "tuning" / "NVIDIA_H200.json").exists()


@pytest.mark.parametrize("change", ["version", "device"])
def test_records_of_another_version_or_device_are_not_used(_cache, change):
    _load()
    with autotune():
        tuning.record(0, KEY, "large", {"large": 1.0})
    path = _cache / "tuning" / "NVIDIA_H200.json"
    data = json.loads(path.read_text())
    data["fi_gemm" if change == "version" else "device"] = "something else"
    path.write_text(json.dumps(data))
    tuning.forget()
    assert _load() == {}
    with autotune():  # the next record starts a fresh file of this version and device
        tuning.record(0, KEY16, "mid", {"mid": 1.0})
    assert set(json.loads(path.read_text())["entries"]) == {tuning._encode(KEY16)}


def test_a_damaged_file_or_unknown_unit_is_ignored_with_a_warning(_cache):
    path = _cache / "tuning" / "NVIDIA_H200.json"
    _load()
    path.write_text("{not json")
    tuning.forget()
    with pytest.warns(UserWarning, match="ignoring tuning records"):
        assert _load() == {}
    path.write_text(json.dumps({"fi_gemm": __version__, "device": DEV, "entries": {
        tuning._encode(KEY): {"config": "no_such_unit"},
        tuning._encode(KEY16): {"config": "large"},
        "bad|key": {"config": "large"}}}))
    tuning.forget()
    with pytest.warns(UserWarning, match="ignoring tuning record"):
        assert _load() == {KEY16: "large"}


def test_fp8_and_16bit_records_are_checked_against_their_own_tables():
    assert api._valid_record(KEY, "t128x128_c2x1") and not api._valid_record(KEY16, "t128x128_c2x1")
    assert api._valid_record(KEY16, "mid") and api._valid_record(KEY, "large")


def test_the_knob_ignores_the_records(_cache):
    _load()
    with autotune():
        tuning.record(0, KEY, "large", {"large": 1.0})
    tuning.forget()
    with knobs.override(FI_GEMM_TUNING="0"):
        assert _load() == {}


def test_autotune_context_nests_and_restores():
    assert not tuning.active()
    with autotune():
        assert tuning.active()
        with autotune(False):  # FlashInfer's autotune(False): run without tuning
            assert not tuning.active()
        with autotune(True):
            assert tuning.active()
        assert tuning.active()
    assert not tuning.active()
    with pytest.raises(RuntimeError), autotune():
        raise RuntimeError("the state is restored on the way out")
    assert not tuning.active()


def test_records_are_per_device_file(_cache):
    _load(0, DEV)
    _load(1, "NVIDIA A100-SXM4-80GB")
    with autotune():
        tuning.record(0, KEY, "large", {"large": 1.0})
        tuning.record(1, KEY16, "mid", {"mid": 1.0})
    files = sorted(p.name for p in (_cache / "tuning").glob("*.json"))
    assert files == ["NVIDIA_A100-SXM4-80GB.json", "NVIDIA_H200.json"]
    tuning.forget()
    assert _load(0, DEV) == {KEY: "large"}
    assert _load(1, "NVIDIA A100-SXM4-80GB") == {KEY16: "mid"}


def test_an_unusable_cache_never_fails_a_gemm(monkeypatch):
    def refuse(name):
        raise tuning.CacheError("kernel cache /x is writable by group or others")
    monkeypatch.setattr(tuning, "_path", refuse)
    with pytest.warns(UserWarning, match="tuning records unavailable"):
        assert _load() == {}
    with pytest.warns(UserWarning, match="could not record"), autotune():
        tuning.record(0, KEY, "large", {"large": 1.0})
    assert tuning.RECORDS[0] == {KEY: "large"}  # the choice still holds in this process


def test_the_dispatch_reads_a_device_file_once(monkeypatch, _cache):
    """api._records, the default path's only new work for M > 16 (first call per device): the
    device's name and arch from the driver, then its file."""
    from types import SimpleNamespace

    calls = []

    def fake_info(index):
        calls.append(index)
        return SimpleNamespace(name=DEV, arch="9.0a")
    monkeypatch.setattr(api, "device_info", fake_info)
    dev = torch.device("cuda", 0)
    assert api._records(dev) == {} and calls == [0]
    with autotune():
        tuning.record(0, KEY16, "mid", {"mid": 1.0})
    tuning.forget()
    assert api._records(dev) == {KEY16: "mid"}
    assert tuning.RECORDS.get(0) == {KEY16: "mid"}  # what the dispatch consults on later calls


def test_tuned_config_times_the_table_once_and_respects_capture(monkeypatch, _cache):
    """api._tuned_config with the GPU parts stood in: _plan (which unit runs), the timer and the
    capture query. It must time every unit of the dtype's table once, keep the fastest, record
    it, and leave graph capture, non-CUTLASS paths and calls outside autotune() to the table."""
    from fi_gemm.dense import spec

    monkeypatch.setattr(api, "device_info", lambda i: type("I", (), {"name": DEV, "arch": "9.0a"}))
    path_of = {"large": "cutlass_sm90", "mid": "cutlass_sm90", "t128x128_c2x1": "cutlass_sm90"}
    monkeypatch.setattr(api, "_plan", lambda *a: (path_of[a[9]], object()))
    fake_us = {"large": 9.0, "mid": 12.0, "t128x128_c2x1": 8.5}
    timed = []

    def fake_time(fn):
        return fake_us[timed[-1]]

    def fake_launch(plan, *a):
        pass

    monkeypatch.setattr(api, "_launch", fake_launch)
    monkeypatch.setattr(tuning, "time_launch", fake_time)
    real_plan = api._plan
    monkeypatch.setattr(api, "_plan", lambda *a: (timed.append(a[9]), real_plan(*a))[1])
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    dev = torch.device("cuda", 0)
    a = torch.empty(320, 1152, dtype=torch.float8_e4m3fn)
    w = torch.empty(1088, 1152, dtype=torch.float8_e4m3fn)
    out = torch.empty(320, 1088, dtype=torch.bfloat16)
    args = ("bmm_fp8", dev, a, w, out, None, None, None, 320, 1088, 1152, 1, (0,) * 6, True, True,
            "auto", "large")
    recs = api._records(dev)
    assert api._tuned_config(*args, recs) == "large" and timed == []  # not tuning: the table
    with autotune():
        capturing[0] = True
        assert api._tuned_config(*args, recs) == "large" and timed == []  # capture: never timed
        capturing[0] = False
        assert api._tuned_config(*args, recs) == "t128x128_c2x1"
    assert sorted(set(timed)) == sorted(spec.CONFIGS_FP8)  # every unit of the fp8 table
    assert tuning.RECORDS[0][KEY] == "t128x128_c2x1"
    timed.clear()
    with autotune():  # recorded: no second timing
        assert api._tuned_config(*args, tuning.RECORDS[0]) == "t128x128_c2x1" and timed == []
    tuning.forget()  # a later process reads the record back
    assert api._tuned_config(*args, api._records(dev)) == "t128x128_c2x1"
    path_of["large"] = "torch"  # the table's path is not a CUTLASS unit: nothing to choose from
    other = args[:8] + (640,) + args[9:]  # a problem without a record
    with autotune(persist=False):
        assert api._tuned_config(*other, tuning.RECORDS[0]) == "large" and timed == ["large"]
