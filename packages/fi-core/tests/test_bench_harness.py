"""The parts of the benchmark harness that need no GPU: metrics, tables, JSON."""

import json

from fi_core import bench


def test_metrics_and_table(tmp_path):
    ours = bench.Timing(100.0, 95.0, 110.0, 30, "graph")
    base = bench.Timing(150.0, 140.0, 160.0, 30, "graph")
    row = bench.BenchRow("r", "8192x8192", ours, bytes=4.8e8, flops=1e12, baseline=("torch", base),
                         target_us=120.0)
    m = row.metrics("NVIDIA H200")
    assert m["tb_s"] == 4.8 and m["pct_of_hbm_peak"] == 100.0
    assert m["tflop_s"] == 10000.0 and m["speedup_vs_baseline"] == 1.5 and m["meets_target"]
    assert m["baseline"]["tflop_s"] == round(1e12 / 150e-6 / 1e12, 1)
    table = bench.format_table([m])
    assert "8192x8192" in table and "torch" in table and "ok" in table
    path = bench.write_results("r", {"gpu": "x"}, [m], tmp_path / "h200")
    data = json.loads(path.read_text())
    assert data["routine"] == "r" and data["results"][0]["config"] == "8192x8192"


def test_gpu_slug():
    assert bench.gpu_slug("NVIDIA H200") == "h200"
    assert bench.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"


def test_rotating_inputs_exceed_l2(monkeypatch):
    import torch

    monkeypatch.setattr(bench, "l2_bytes", lambda device=None: 1000)
    sets = bench.rotating_inputs(lambda i: (torch.empty(100, dtype=torch.float32),))
    assert len(sets) * 400 >= 3 * 1000


def test_plot_writes_png(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    ours = bench.Timing(10.0, 9.0, 11.0, 30, "graph")
    rows = [bench.BenchRow("r", f"cfg{i}", ours, baseline=("torch", ours)).metrics() for i in range(3)]
    path = bench.plot("r", rows, tmp_path / "r.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_apply_tuning_sets_given_options_and_clears_caches():
    import functools
    import types

    from fi_core.bench import RoutineArgs, apply_tuning

    calls = []

    @functools.cache
    def spec_fn(x):
        calls.append(x)
        return (x, mod.A, mod.B)

    mod = types.SimpleNamespace(A=0, B=None, spec_fn=spec_fn)
    names = {"a": "A", "b": "B"}
    assert spec_fn(1) == (1, 0, None)
    assert apply_tuning(RoutineArgs(options={}), mod, names, spec_fn) == ""
    assert spec_fn(1) == (1, 0, None) and calls == [1]          # nothing given: cache kept
    assert apply_tuning(RoutineArgs(options={"b": "3", "other": "x"}), mod, names, spec_fn) == " [b=3]"
    assert (mod.A, mod.B) == (0, 3)
    assert spec_fn(1) == (1, 0, 3) and calls == [1, 1]          # rebuilt with the new value
    assert apply_tuning(RoutineArgs(options={"a": "2", "b": "4"}), mod, names, spec_fn) == " [a=2 b=4]"
    assert spec_fn(1) == (1, 2, 4)


def test_host_timers_take_turns_and_summarise_batches(monkeypatch):
    """time_host_interleaved runs batch i of every function before batch i + 1 of any, and both
    host timers return (median, minimum, maximum) of their batch means."""
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    stats = bench.time_host_interleaved(fns, iters=3, warmup=1, batches=4)
    assert calls == ["a", "b"] + (["a"] * 3 + ["b"] * 3) * 4
    assert set(stats) == {"a", "b"}
    for med, low, high in stats.values():
        assert 0 < low <= med <= high
    med, low, high = bench.time_host_stats(lambda: None, iters=5, warmup=1, batches=3)
    assert 0 < low <= med <= high
    assert bench.time_host(lambda: None, iters=5, warmup=1) > 0


def test_rows_report_the_ceiling_they_name(monkeypatch):
    """A row that names a ceiling gets % of it, measured once per routine after its rows; a row
    that names none (or has no FLOPs) gets nothing; ``ceiling=off`` skips the measurement."""
    import pytest

    calls = []
    monkeypatch.setitem(bench.CEILINGS, "gemm16", lambda device: calls.append(device) or ("gemm x", 800.0))
    ours = bench.Timing(100.0, 95.0, 110.0, 30, "graph")
    rows = [bench.BenchRow("r", "a", ours, flops=6e10, ceiling="gemm16"),
            bench.BenchRow("r", "b", ours, flops=4e10, ceiling="gemm16"),
            bench.BenchRow("r", "c", ours, flops=4e10),
            bench.BenchRow("r", "d", ours, bytes=1e8, ceiling="gemm16")]
    ceilings = bench.measure_ceilings(rows, bench.RoutineArgs(device="cuda:1"))
    assert calls == ["cuda:1"] and ceilings == {"gemm16": ("gemm x", 800.0)}
    m = [r.metrics("NVIDIA H200", ceilings) for r in rows]
    assert m[0]["tflop_s"] == 600.0 and m[0]["pct_of_ceiling"] == 75.0
    assert m[0]["ceiling"] == {"name": "gemm x", "tflop_s": 800.0} and m[1]["pct_of_ceiling"] == 50.0
    assert "pct_of_ceiling" not in m[2] and "pct_of_ceiling" not in m[3]
    table = bench.format_table(m)
    assert "%ceil" in table.splitlines()[0] and "75.00" in table
    assert table.splitlines()[-1] == "%ceil: of gemm x at 800.0 TFLOP/s, same run"
    assert bench.measure_ceilings(rows, bench.RoutineArgs(options={"ceiling": "off"})) == {}
    assert calls == ["cuda:1"]
    with pytest.raises(KeyError, match="unknown ceiling 'gemm8'"):
        bench.measure_ceilings([bench.BenchRow("r", "e", ours, flops=1.0, ceiling="gemm8")], bench.RoutineArgs())


def test_run_routine_measures_the_ceiling_after_the_rows(monkeypatch):
    order = []

    def fn(args):
        order.append("row")
        yield bench.BenchRow("r", "a", bench.Timing(10.0, 9.0, 11.0, 30, "graph"), flops=8e9, ceiling="gemm16")

    monkeypatch.setitem(bench.ROUTINES, "_ceiling_probe", bench.Routine("_ceiling_probe", "fi-core", fn))
    monkeypatch.setitem(bench.CEILINGS, "gemm16", lambda device: order.append("ceiling") or ("g", 1000.0))
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "NVIDIA H100 80GB HBM3"})
    env, rows = bench.run_routine("_ceiling_probe", bench.RoutineArgs())
    assert order == ["row", "ceiling"] and rows[0]["pct_of_ceiling"] == 80.0
