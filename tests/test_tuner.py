"""The kernel tuner (kernels/tuner.py): the faster candidate is chosen and the table cached,
weights are timed where a forward meets them, projections interpolate, a shape timed for one
table is read for the next, and the time budget: shapes past it fall back (to a same-family
group's timed choice, else the untuned default), the table and a log line say so, and a later
start times exactly what was left. Every timing here runs on a fake clock, so no result
depends on how busy the machine is."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F


class FakeClock:
    """The tuner's clock: time passes only when a test's candidate says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_tuner_picks_the_faster_candidate_and_caches(tmp_path, monkeypatch):
    """One candidate made slow (20 ms per call on the tuner's clock, a fake one: the machine's
    load cannot reorder them): the tuner must choose the other at every row count, write the
    table, and a second tuner must read it back without timing anything."""
    from specserve.kernels import linear, tuner
    from specserve.kernels.linear import DenseLinear

    clock = FakeClock()

    def slow(x, w, b):
        clock.advance(0.02)
        return F.linear(x, w, b)

    monkeypatch.setattr(linear, "DENSE_KERNELS", {"slow": slow, "fast": F.linear})
    monkeypatch.setattr(tuner, "DENSE_KERNELS", linear.DENSE_KERNELS)
    model = torch.nn.Sequential(DenseLinear(32, 48), DenseLinear(32, 48), DenseLinear(48, 32))
    t = tuner.KernelTuner(tmp_path, "test", repeats=3, clock=clock)
    table = t.tune(model, [1, 2, 5])
    assert set(table.groups) == {"dense:float32:48x32", "dense:float32:32x48"}
    for group in table.groups.values():
        assert set(group.choice.values()) == {"fast"}
        for timing in group.timings.values():
            assert timing["slow"] > timing["fast"]
    assert model[0].plan is not None and model[0].plan.get(3) == "fast"
    assert model[0].plan is model[1].plan  # one plan per shape
    x = torch.randn(3, 32)
    torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias))

    def no_measuring(*_a, **_k):
        raise AssertionError("the cached table should have been read")

    monkeypatch.setattr(tuner.KernelTuner, "measure", no_measuring)
    again = tuner.KernelTuner(tmp_path, "test").tune(model, [1, 2, 5])
    assert again.groups["dense:float32:48x32"].choice == table.groups["dense:float32:48x32"].choice
    assert again.projection_seconds(5) == pytest.approx(table.projection_seconds(5))


def test_tuner_times_from_memory_only_when_weights_exceed_the_last_level_cache(monkeypatch):
    """Weights that fit in the last-level cache are timed cached (no eviction); weights that do
    not are timed after their cache lines are flushed (CLFLUSHOPT, where the CPU has it) or a
    read of twice that cache, before every timed pass of every candidate, never inside the
    timing."""
    from specserve.kernels import quant_ext, tuner
    from specserve.kernels.linear import DenseLinear

    llc = tuner.last_level_cache_bytes()  # sysfs's answer here, when it has one
    assert llc is None or llc >= 1 << 20
    model = torch.nn.Sequential(DenseLinear(64, 64), DenseLinear(64, 64))  # 2 x 16 KB
    groups = tuner.model_groups(model)
    monkeypatch.setattr(tuner, "last_level_cache_bytes", lambda: 1 << 20)
    assert tuner.cache_evictor(groups) is None
    monkeypatch.setattr(tuner, "last_level_cache_bytes", lambda: 16 << 10)
    flushing = "clflushopt" in quant_ext.cpu_flags() and quant_ext.available()
    if flushing:  # the flush gets exactly the timed modules' weights, and changes no byte
        flushed: list[torch.Tensor] = []
        real = quant_ext.load().evict_from_cache
        monkeypatch.setattr(quant_ext.load(), "evict_from_cache",
                            lambda ts: (flushed.extend(ts), real(ts)))
        before = model[0].weight.clone()
        tuner.cache_evictor(groups)([model[0]])
        assert [t.data_ptr() for t in flushed] == [model[0].weight.data_ptr()]
        assert torch.equal(model[0].weight, before)
    monkeypatch.setattr(quant_ext, "cpu_flags", lambda: set())  # a CPU without CLFLUSHOPT
    evict = tuner.cache_evictor(groups)
    reads: list[int] = []
    monkeypatch.setattr(torch.Tensor, "sum", lambda t: reads.append(t.numel() * 4))
    evict([model[0]])
    assert reads == [32 << 10]  # twice the cache
    monkeypatch.undo()
    order: list[str] = []
    runs = [{"a": lambda: order.append("a"), "b": lambda: order.append("b")}]
    tuner.time_candidates(runs, 2, lambda: order.append("evict"))
    assert order == ["a", "b"] + ["evict", "a", "evict", "b"] * 2  # warm-up, then 2 repeats


def test_long_shapes_are_timed_in_fewer_rounds():
    """On the fake clock: passes of 0.4 and 0.5 s stop after MIN_REPEATS rounds (the timed
    passes reach LONG_SHAPE_S), passes of 1 ms get every round asked for."""
    from specserve.kernels import tuner

    clock = FakeClock()
    calls: list[str] = []

    def candidate(name: str, seconds: float) -> Callable[[], None]:
        def call() -> None:
            calls.append(name)
            clock.advance(seconds)
        return call

    long = tuner.time_candidates([{"a": candidate("a", 0.4), "b": candidate("b", 0.5)}], 5,
                                 clock=clock)
    assert calls.count("a") == 1 + tuner.MIN_REPEATS  # warm-up, then 2 rounds (1.8 s timed)
    assert long == {"a": pytest.approx(0.4), "b": pytest.approx(0.5)}
    calls.clear()
    tuner.time_candidates([{"a": candidate("a", 1e-3), "b": candidate("b", 1e-3)}], 5,
                          clock=clock)
    assert calls.count("a") == 1 + 5


def test_projection_seconds_interpolates_between_measured_counts():
    """Hand-worked: linear between measured counts (9 rows are not priced as 8), the smallest
    count below it, proportional above the largest; groups add up."""
    from specserve.kernels.tuner import GroupResult, TuneTable

    table = TuneTable({"a": GroupResult(seconds={1: 1.0, 8: 2.0, 16: 4.0}),
                       "b": GroupResult(seconds={1: 0.5, 16: 0.5})})
    assert table.projection_seconds(1) == pytest.approx(1.5)
    assert table.projection_seconds(4) == pytest.approx(1.0 + 3 / 7 + 0.5)
    assert table.projection_seconds(9) == pytest.approx(2.25 + 0.5)
    assert table.projection_seconds(12) == pytest.approx(3.0 + 0.5)
    assert table.projection_seconds(32) == pytest.approx(8.0 + 1.0)
    assert TuneTable().projection_seconds(4) is None


def test_row_plan_lookup():
    from specserve.kernels.linear import RowPlan

    plan = RowPlan("linear")
    assert plan.get(7) == "linear"
    plan.set(4, "a")
    plan.set(1, "b")
    plan.set(16, "c")
    assert [plan.get(r) for r in (1, 2, 4, 15, 16, 500)] == ["b", "b", "a", "a", "c", "c"]


# ---- the budget -------------------------------------------------------------------------------

# Two form families: K=32 (a 48-row group of two modules and a 96-row one) and K=48.
GROUPS = {"dense:float32:48x32", "dense:float32:96x32", "dense:float32:32x48"}


def _budget_model():
    from specserve.kernels.linear import DenseLinear

    torch.manual_seed(0)
    return torch.nn.Sequential(DenseLinear(32, 48), DenseLinear(32, 48), DenseLinear(48, 32),
                               DenseLinear(32, 96))


def _fake_kernels(monkeypatch, clock: FakeClock) -> list[int]:
    """"linear" (the untuned default) costs 20 ms a call, "fast" 1 ms, on ``clock``; returns
    the row counts of every timed call, in order."""
    from specserve.kernels import linear, tuner

    calls: list[int] = []

    def kernel(cost: float):
        def run(x, w, b):
            calls.append(x.shape[0])
            clock.advance(cost)
            return F.linear(x, w, b)
        return run

    monkeypatch.setattr(linear, "DENSE_KERNELS", {"linear": kernel(0.02), "fast": kernel(0.001)})
    monkeypatch.setattr(tuner, "DENSE_KERNELS", linear.DENSE_KERNELS)
    return calls


def test_work_order_is_fewest_rows_first_each_familys_smallest_group_leading():
    from specserve.kernels.tuner import form_family, work_order

    assert form_family("block:q4_1:960x576") == "block:q4_1:576"
    order = work_order(["block:q4_1:3072x576", "block:q4_1:576x1536", "block:q4_1:960x576",
                        "block:q8_0:49152x576"], [5, 1])
    firsts = ["block:q4_1:960x576", "block:q4_1:576x1536", "block:q8_0:49152x576"]
    assert order == [(sig, rows) for rows in (1, 5) for sig in [*firsts, "block:q4_1:3072x576"]]


def test_a_budget_of_zero_times_nothing_and_keeps_the_untuned_defaults(tmp_path, monkeypatch,
                                                                       caplog):
    from specserve.kernels import tuner

    clock = FakeClock()
    calls = _fake_kernels(monkeypatch, clock)
    model = _budget_model()
    with caplog.at_level(logging.INFO, logger="specserve.kernels.tuner"):
        table = tuner.KernelTuner(tmp_path, "zero", budget_s=0, clock=clock).tune(model, [1, 4])
    assert calls == [] and set(table.groups) == GROUPS
    for group in table.groups.values():
        assert group.choice == {1: "linear", 4: "linear"}
        assert group.fallback == {1: "default", 4: "default"}
        assert group.timings == {} and group.seconds == {}
    assert table.num_untimed == 6 and table.projection_seconds(2) is None
    assert model[0].plan is not None and model[0].plan.get(4) == "linear"
    assert any("timed 0 of 6 shapes" in r.getMessage() and "6 fell back" in r.getMessage()
               and "0 to a same-family group's choice, 6 to the untuned defaults" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["groups"]["dense:float32:48x32"]["fallback"] == {
        "1": "default", "4": "default"}


def test_a_budget_cut_falls_back_and_a_later_start_times_exactly_the_rest(tmp_path, monkeypatch,
                                                                          caplog):
    """Each candidate call costs a fixed time on the fake clock (21 ms for both candidates,
    twice over with repeats=1 and the warm-up: 42 ms per module per shape). A 0.1 s budget
    times the K=48 group (one module: 42 ms) and the 48x32 group (two modules: 84 ms, started
    with 58 ms left: a group's first shape always runs) at 1 row, then stops: 96x32 at 1 row
    takes 48x32's timed choice, every shape at 4 and 8 rows the untuned default. A second start
    with no budget times those 7 shapes and nothing else."""
    from specserve.kernels import tuner

    clock = FakeClock()
    calls = _fake_kernels(monkeypatch, clock)
    model = _budget_model()
    with caplog.at_level(logging.INFO, logger="specserve.kernels.tuner"):
        first = tuner.KernelTuner(tmp_path, "cut", repeats=1, budget_s=0.1, clock=clock).tune(
            model, [1, 4, 8])
    assert clock.now == pytest.approx(0.042 + 0.084)
    groups = first.groups
    assert groups["dense:float32:32x48"].choice[1] == groups["dense:float32:48x32"].choice[1] \
        == "fast"
    assert set(groups["dense:float32:32x48"].timings) == {1}
    assert set(groups["dense:float32:48x32"].timings) == {1}
    assert groups["dense:float32:96x32"].fallback[1] == "dense:float32:48x32"
    assert groups["dense:float32:96x32"].choice[1] == "fast"  # shared, not timed
    assert groups["dense:float32:96x32"].timings == {}
    for sig in GROUPS:
        for rows in (4, 8):
            assert groups[sig].choice[rows] == "linear" and groups[sig].fallback[rows] == "default"
    assert first.num_untimed == 7
    message = next(r.getMessage() for r in caplog.records if "fell back" in r.getMessage())
    assert "timed 2 of 9 shapes" in message and "7 fell back untimed" in message
    assert "1 to a same-family group's choice, 6 to the untuned defaults" in message
    timed_before = {sig: dict(g.timings) for sig, g in groups.items()}

    calls.clear()
    second = tuner.KernelTuner(tmp_path, "cut", repeats=1, budget_s=None, clock=clock).tune(
        model, [1, 4, 8])
    # 7 shapes, 2 candidates, 2 passes per module: 96x32 at 1 row, then every group at 4 and 8
    assert sorted(calls) == sorted([1] * 4 + [4] * 16 + [8] * 16)
    assert second.num_untimed == 0
    for sig, g in second.groups.items():
        assert set(g.choice.values()) == {"fast"} and g.fallback == {}
        assert {r: t for r, t in g.timings.items() if r in timed_before[sig]} == timed_before[sig]
    assert second.projection_seconds(6) is not None
    again = tuner.KernelTuner(tmp_path, "cut", budget_s=0, clock=clock).tune(model, [1, 4, 8])
    assert again.num_untimed == 0  # the completed table was written back and is read as is


def test_the_start_deadline_cuts_the_budget_but_leaves_its_minimum(tmp_path, monkeypatch):
    """The fake kernels of the budget cut above (42 ms a module a shape): a deadline 0.1 s
    after the tuner starts stops it where a 0.1 s budget does (2 of 9 shapes timed), under the
    default 60 s budget; a deadline already past still leaves ``MIN_BUDGET_S`` (here 0.1 s:
    the same 2 shapes); a deadline later than the budget leaves the budget in charge."""
    from specserve.kernels import tuner

    monkeypatch.setattr(tuner, "MIN_BUDGET_S", 0.1)
    for name, deadline, budget in (("soon", 0.1, tuner.DEFAULT_BUDGET_S), ("past", -30.0, 60.0),
                                   ("late", 100.0, 0.1)):
        clock = FakeClock()
        calls = _fake_kernels(monkeypatch, clock)
        table = tuner.KernelTuner(tmp_path / name, name, repeats=1, budget_s=budget,
                                  clock=clock, deadline=deadline).tune(_budget_model(), [1, 4, 8])
        assert table.num_untimed == 7, name
        assert sorted(calls) == [1] * 12, name  # 3 modules, 2 candidates, 2 passes
    clock = FakeClock()
    _fake_kernels(monkeypatch, clock)
    whole = tuner.KernelTuner(tmp_path / "whole", "whole", repeats=1, clock=clock,
                              deadline=100.0).tune(_budget_model(), [1, 4, 8])
    assert whole.num_untimed == 0


def test_a_shape_timed_for_one_table_is_read_for_the_next(tmp_path, monkeypatch, caplog):
    """Two engine configurations over the same shapes ask for rows [1, 4] and [1, 4, 8]: the
    second times only the 8-row shapes (4 modules, 2 candidates, 2 passes: 16 calls) and reads
    the rest from the shape store, equal to the first table's. Another repeats count is
    another measurement: nothing is read for it."""
    from specserve.kernels import tuner

    clock = FakeClock()
    calls = _fake_kernels(monkeypatch, clock)
    first = tuner.KernelTuner(tmp_path, "a", repeats=1, clock=clock).tune(_budget_model(), [1, 4])
    calls.clear()
    with caplog.at_level(logging.INFO, logger="specserve.kernels.tuner"):
        second = tuner.KernelTuner(tmp_path, "b", repeats=1, clock=clock).tune(
            _budget_model(), [1, 4, 8])
    assert calls == [8] * 16
    for sig in GROUPS:
        for rows in (1, 4):
            assert second.groups[sig].timings[rows] == first.groups[sig].timings[rows]
            assert second.groups[sig].choice[rows] == first.groups[sig].choice[rows] == "fast"
        assert second.groups[sig].choice[8] == "fast" and not second.groups[sig].fallback
    assert any("timed 3 shapes" in r.getMessage() and "(6 read from earlier timings)"
               in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    calls.clear()
    tuner.KernelTuner(tmp_path, "c", repeats=2, clock=clock).tune(_budget_model(), [1])
    assert calls == [1] * (4 * 2 * 3)  # warm-up and 2 repeats, every module and candidate


# ---- the attention form's budget --------------------------------------------------------------


class TickingClock:
    """A clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_attention_form_budget_cuts_passes_and_the_choice_stands(tmp_path, monkeypatch, caplog):
    """Budget 0: the warm-up and one timed pass, no more (a clock that ticks on every read, so
    the budget is spent at once); the record says 1 of 9 passes and a later start reads that
    form without timing. No budget: all 9 passes. (Small synthetic caches keep it quick.)"""
    from specserve.kernels import attention_form

    forms = attention_form.supported_forms(64)
    assert forms, "the C++ extension must build here"
    monkeypatch.setattr(attention_form, "_CONTEXTS", (64,))
    monkeypatch.setattr(attention_form, "_LAYERS", 1)
    cost, passes = attention_form.time_forms(9, 3, 64, forms, budget_s=None, clock=TickingClock())
    assert passes == 9 and set(cost) == set(forms)
    cost, passes = attention_form.time_forms(9, 3, 64, forms, budget_s=0, clock=TickingClock())
    assert passes == 1 and set(cost) == set(forms)
    if len(forms) < 2:
        return  # one form: nothing is timed, nothing cached
    with caplog.at_level(logging.INFO, logger="specserve.kernels.attention_form"):
        form = attention_form.choose_form(9, 3, 64, tmp_path, budget_s=0, clock=TickingClock())
    assert form in forms
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("attention-*.json")]
    assert (record["form"], record["passes"], record["of"]) == (form, 1, 9)
    assert any("cut by its 0s budget: 1 of 9 passes" in r.getMessage() for r in caplog.records)

    def no_timing(*_a, **_k):
        raise AssertionError("the cached form must be read, not re-timed")

    monkeypatch.setattr(attention_form, "time_forms", no_timing)
    assert attention_form.choose_form(9, 3, 64, tmp_path) == form


def test_a_block_layer_without_the_kernels_is_not_tuned():
    """A block layer whose C++ kernels cannot run (no usable extension) runs its one dense
    fallback: the tuner leaves it out instead of choosing among no candidates."""
    import torch
    from torch import nn

    from specserve.kernels import tuner
    from specserve.kernels.quant import BlockQuantLinear, quantize

    with_kernel = BlockQuantLinear(quantize(torch.randn(64, 64) * 0.05, "q8_0"))
    without = BlockQuantLinear(quantize(torch.randn(32, 64) * 0.05, "q8_0"))
    without._ext = None
    groups = tuner.model_groups(nn.Sequential(with_kernel, without))
    assert list(groups) == (["block:q8_0:64x64"] if with_kernel.has_kernel else [])
    x = torch.randn(3, 64)
    torch.testing.assert_close(without(x), x @ without.weight.dequantize().T)
