"""Choosing the thread setup at start-up (kernels/thread_choice.py, engine/thread_setup.py): the
least cost over a quiet and a disturbed timing wins, within the budget, cached per machine and
model shape; nothing is measured when the user fixed the threads or the model is tiny; the
start-up log says which and how; no candidate changes a greedy token.

The choosing logic runs on a fake machine: a clock that only moves when a step runs, by a cost
set per setup and per condition (quiet, disturbed), so every verdict here is decided by the
numbers the test gives, never by how busy the machine is."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator

import pytest

from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError
from specserve.core.sampling_params import SamplingParams
from specserve.engine import thread_setup
from specserve.engine.llm_engine import LLMEngine
from specserve.kernels import thread_choice, thread_policy
from specserve.kernels.thread_choice import ThreadSetup, candidates
from specserve.kernels.thread_policy import ThreadPolicy
from tests.helpers.servers import engine_config


class FakeMachine:
    """``step`` advances ``clock`` by the cost (seconds) of the setup in force, quiet or inside
    ``disturb()``; counts the steps each setup ran."""

    def __init__(self, costs: dict[ThreadSetup, tuple[float, float]]) -> None:
        self.costs = costs
        self.now = 0.0
        self.disturbed = False
        self.steps: Counter[ThreadSetup] = Counter()

    def clock(self) -> float:
        return self.now

    def step(self) -> None:
        setup = ThreadSetup.current()
        self.steps[setup] += 1
        self.now += self.costs[setup][self.disturbed]

    @contextlib.contextmanager
    def disturb(self) -> Iterator[None]:
        self.disturbed = True
        try:
            yield
        finally:
            self.disturbed = False


@pytest.fixture(autouse=True)
def _no_load_reading(monkeypatch):
    """The machine's load is not read (a test must not pass or fail by how busy it is);
    the test of that rule gives its own snapshots."""
    monkeypatch.setattr(thread_choice, "cpu_snapshot", lambda: None)


@pytest.fixture
def restored() -> Iterator[None]:
    before = ThreadSetup.current()
    yield
    before.apply()


SETUPS = candidates(2)  # team 2 / torch 1; torch 2; one thread; team 2 short; team 2 long


def test_candidates_never_spin_forever_nor_pin_and_start_with_the_full_team():
    for cores in (2, 4, 16):
        setups = candidates(cores)
        assert setups[0] == ThreadSetup(1, ThreadPolicy(threads=cores))
        assert ThreadSetup(cores) in setups and ThreadSetup(1) in setups
        assert all(s.policy.spin_us >= 0 and not s.policy.openmp for s in setups)
        assert len(set(setups)) == len(setups)
    assert ThreadSetup(1, ThreadPolicy(threads=2)) in candidates(4)  # half the cores
    assert candidates(1) == (ThreadSetup(1),)
    assert SETUPS[0].name == "threads 2 (torch ops on 1), pool spin_us=200,wait_us=50"
    assert ThreadSetup(2).name == "threads 2, pool spin_us=200,wait_us=50"
    assert ThreadSetup(1).name == "threads 1"


def test_the_least_cost_over_quiet_and_disturbed_wins(tmp_path, restored):
    """The fastest quiet setup loses when a waking thread hurts it most; a setup over twice
    the best is timed in the first round only."""
    team, torch2, one, short, long = SETUPS
    costs = {team: (1.0e-3, 2.4e-3),  # 1 + 2.4/1.3 = 2.85
             torch2: (1.2e-3, 1.3e-3),  # 1.2 + 1 = 2.2: the least
             one: (2.0e-3, 2.0e-3),  # 2 + 1.54 = 3.54
             short: (1.1e-3, 1.5e-3),  # 1.1 + 1.15 = 2.25
             long: (5.0e-3, 5.0e-3)}  # over 2x the best: pruned
    fake = FakeMachine(costs)
    path = tmp_path / "threads.json"
    choice = thread_choice.choose(fake.step, path, SETUPS, budget_s=10.0, clock=fake.clock,
                                  disturb=fake.disturb)
    assert choice.setup == torch2 and ThreadSetup.current() == torch2
    assert choice.how.startswith("chosen by measurement (5 of 5 candidates in")
    per_round = 2 * (thread_choice.MAX_STEPS + 1)  # quiet + disturbed, one untimed each
    rounds = thread_choice.ROUNDS
    assert fake.steps[long] == per_round  # the first round
    for s in (torch2, one, short):
        assert fake.steps[s] == rounds * per_round
    assert fake.steps[team] == rounds * per_round + 2  # and the two first steps
    assert fake.now <= 10.0 and path.is_file()


def test_a_cached_choice_is_applied_untimed(tmp_path, restored):
    fake = FakeMachine({s: (1e-3 * (i + 1), 1e-3 * (i + 1)) for i, s in enumerate(SETUPS)})
    path = tmp_path / "threads.json"
    first = thread_choice.choose(fake.step, path, SETUPS, clock=fake.clock, disturb=fake.disturb)
    assert first.setup == SETUPS[0]
    ThreadSetup(2).apply()

    def untimed() -> None:
        raise AssertionError("a cached choice must not be measured")

    again = thread_choice.choose(untimed, path, SETUPS)
    assert again.setup == first.setup and ThreadSetup.current() == first.setup
    assert again.describe() == f"{first.setup.name}, chosen by measurement (cached)"
    # a cache naming a setup that is no longer a candidate is measured afresh
    assert thread_choice.choose(fake.step, path, SETUPS[1:], clock=fake.clock,
                                disturb=fake.disturb).how != again.how


def test_the_budget_bounds_the_measurement_and_a_cut_one_is_not_cached(tmp_path, restored):
    """Steps of 0.1 s against a 2 s budget: the measurement stops before the budget is passed,
    chooses among what it timed, and leaves no cache (a later start measures again)."""
    costs = {s: (0.1, 0.1 + 0.01 * i) for i, s in enumerate(SETUPS)}
    fake = FakeMachine(costs)
    path = tmp_path / "threads.json"
    choice = thread_choice.choose(fake.step, path, SETUPS, budget_s=2.0, clock=fake.clock,
                                  disturb=fake.disturb)
    assert fake.now <= 2.0 + 1e-9
    assert "budget spent: not cached" in choice.how and not path.exists()
    assert choice.setup in SETUPS and ThreadSetup.current() == choice.setup
    before = sum(fake.steps.values())
    thread_choice.choose(fake.step, path, SETUPS, budget_s=2.0, clock=fake.clock,
                         disturb=fake.disturb)
    assert sum(fake.steps.values()) > before  # measured again
    # a budget under one step's cost times nothing and says so
    fake = FakeMachine({s: (5.0, 5.0) for s in SETUPS})
    untimed = thread_choice.choose(fake.step, path, SETUPS, budget_s=1.0, clock=fake.clock,
                                   disturb=fake.disturb)
    assert untimed.setup == SETUPS[0] and "untimed" in untimed.how and not path.exists()


def test_a_choice_made_while_others_took_the_cores_is_not_cached(tmp_path, restored,
                                                                 monkeypatch):
    """Other processes' CPU time over the measurement (from /proc snapshots): above
    BUSY_CORES on average the choice is applied, not cached; below, cached."""
    fake = FakeMachine({s: (1e-3 * (i + 1), 1e-3 * (i + 1)) for i, s in enumerate(SETUPS)})
    path = tmp_path / "threads.json"
    for others, cached in ((0.9, False), (0.1, True)):
        shots = iter([thread_choice.CpuSnapshot(0.0, 100.0, 10.0),
                      thread_choice.CpuSnapshot(2.0, 100.0 + 2 * (others + 1.5), 13.0)])
        monkeypatch.setattr(thread_choice, "cpu_snapshot", lambda shots=shots: next(shots))
        choice = thread_choice.choose(fake.step, path, SETUPS, clock=fake.clock,
                                      disturb=fake.disturb)
        assert choice.setup == SETUPS[0] and ThreadSetup.current() == SETUPS[0]
        assert path.is_file() == cached, (others, choice.how)
        assert ("not cached" in choice.how) != cached
        if not cached:
            assert f"other processes took {others:.2f} cores" in choice.how
    assert thread_choice.others_cores(thread_choice.CpuSnapshot(0.0, 1.0, 1.0),
                                      thread_choice.CpuSnapshot(0.1, 9.0, 1.0)) is None


def test_team_candidates_keep_the_team_and_vary_where_torch_runs():
    for team in (2, 4):
        setups = thread_choice.team_candidates(team)
        assert {s.team for s in setups} == {team}
        assert {s.torch_threads for s in setups} == {1, team}
        assert setups[0] == candidates(team)[0]
    assert thread_choice.team_candidates(1) == (ThreadSetup(1),)


class CountingClock:
    """Moves 1 ms per reading: the real probe step runs, but every timing reads the same, so
    the measurement completes within any budget of a few seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def _ready_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert len(lines) == 1, lines
    return lines[0]


def test_start_up_measures_the_decode_step_caches_and_logs(model_dir, monkeypatch, caplog,
                                                            restored):
    """With the size floor lowered, the engine's probe (a real decode forward of its model and
    a greedy token through the engine's own sampler, whose torch ops are part of what a setup
    costs) is timed under every candidate and the choice cached; the next engine of
    the same shape reads it and says so in its start-up line. The probe leaves the KV pool
    zeroed. (The counting clock makes the measurement complete whatever the machine's load.)"""
    monkeypatch.delenv(thread_policy.ENV, raising=False)
    config = engine_config(model_dir, draft_model="none")
    engine = LLMEngine(config)  # under the size floor: not measured
    monkeypatch.setattr(thread_setup, "MIN_MEASURED_PARAMS", 0)
    monkeypatch.setattr(thread_choice, "usable_cores", lambda: 2)  # SETUPS, on any machine
    steps = Counter()
    real = engine.runner.forward

    def counted(*args, **kwargs):
        steps[ThreadSetup.current()] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", counted)
    sampled = []
    real_sample = thread_setup.rejection_sample

    def sample(logits, rows, *args):
        sampled.append(logits.shape[0] == len(rows) == 1 and rows[0].draft_token_ids == [])
        return real_sample(logits, rows, *args)

    monkeypatch.setattr(thread_setup, "rejection_sample", sample)
    choice = thread_setup.choose_threads(engine.config, engine.runner, clock=CountingClock())
    assert choice.how == f"chosen by measurement ({len(SETUPS)} of {len(SETUPS)} candidates in " \
                         f"{choice.how.split(' in ')[1]}"
    assert set(steps) == set(SETUPS)  # each one ran the probe
    assert len(sampled) == sum(steps.values()) and all(sampled)  # every step sampled its row
    assert not engine.runner.kv_cache.any()
    with caplog.at_level(logging.INFO, logger="specserve.engine.llm_engine"):
        again = LLMEngine(config)
    assert again.threads.setup == choice.setup
    assert _ready_line(caplog).endswith(f"; {choice.setup.name}, chosen by measurement (cached)")
    off = LLMEngine(engine_config(model_dir, draft_model="none", kernel_tuning=False))
    assert off.threads.how == "defaults (--no-kernel-tuning)"


@pytest.mark.parametrize("flag, env, how", [
    ({"num_threads": 1}, None, "fixed by --num-threads 1"),
    ({}, "spin_us=50,wait_us=20", "fixed by SPECSERVE_THREAD_POLICY=spin_us=50,wait_us=20"),
    ({"num_threads": 2}, "threads=2", "fixed by --num-threads 2 and "
                                      "SPECSERVE_THREAD_POLICY=spin_us=200,wait_us=50,threads=2"),
])
def test_threads_the_user_fixed_are_not_measured(model_dir, monkeypatch, caplog, restored, flag,
                                                 env, how):
    def no_measuring(*args, **kwargs):
        raise AssertionError("fixed threads must not be measured")

    monkeypatch.setattr(thread_setup, "MIN_MEASURED_PARAMS", 0)
    monkeypatch.setattr(thread_choice, "measure", no_measuring)
    if env is None:
        monkeypatch.delenv(thread_policy.ENV, raising=False)
    else:
        monkeypatch.setenv(thread_policy.ENV, env)
    with caplog.at_level(logging.INFO, logger="specserve.engine.llm_engine"):
        engine = LLMEngine(engine_config(model_dir, draft_model="none", **flag))
    assert engine.threads.how == how
    assert _ready_line(caplog).endswith(f"; {engine.threads.describe()}")
    if env is not None:  # the variable's policy is in force, even in a process that loaded
        assert thread_policy.current() == ThreadPolicy.parse(env)  # the kernels before


def test_num_threads_fixes_the_team_and_placement_is_measured(model_dir, monkeypatch, caplog,
                                                              restored):
    """--num-threads 2 alone fixes the team; torch's own ops on one thread or on the team
    (and the pool's waits) are still timed, among the candidates of that team."""
    monkeypatch.delenv(thread_policy.ENV, raising=False)
    monkeypatch.setattr(thread_setup, "MIN_MEASURED_PARAMS", 0)
    timed = []
    real = thread_choice.measure

    def recorded(step, setups, **kw):
        timed.append(setups)
        return real(step, setups, **{**kw, "clock": CountingClock()})

    monkeypatch.setattr(thread_choice, "measure", recorded)
    with caplog.at_level(logging.INFO, logger="specserve.engine.llm_engine"):
        engine = LLMEngine(engine_config(model_dir, draft_model="none", num_threads=2))
    assert timed == [thread_choice.team_candidates(2)]
    assert engine.threads.setup.team == 2 and engine.threads.setup in timed[0]
    assert engine.threads.how.startswith("team fixed by --num-threads 2, chosen by measurement")
    assert _ready_line(caplog).endswith(f"; {engine.threads.describe()}")


def test_num_threads_unmeasured_resets_an_earlier_team(model_dir, monkeypatch, restored):
    """Not measured (--no-kernel-tuning), --num-threads 2 runs a team of 2 even where an engine
    built before in the process left the pool on a team of its own."""
    monkeypatch.delenv(thread_policy.ENV, raising=False)
    ThreadSetup(1, ThreadPolicy(threads=3)).apply()
    engine = LLMEngine(engine_config(model_dir, draft_model="none", num_threads=2,
                                     kernel_tuning=False))
    assert engine.threads.setup.team == 2 and engine.threads.setup.torch_threads == 2
    assert engine.threads.how == "team fixed by --num-threads 2, defaults (--no-kernel-tuning)"


def test_a_malformed_policy_variable_is_a_config_error(model_dir, monkeypatch):
    monkeypatch.setenv(thread_policy.ENV, "spin=5")
    with pytest.raises(ConfigError, match="SPECSERVE_THREAD_POLICY.*unset "
                                          "SPECSERVE_THREAD_POLICY to let the engine choose"):
        LLMEngine(engine_config(model_dir, draft_model="none"))


def test_a_tiny_model_is_not_measured(model_dir, monkeypatch, restored):
    monkeypatch.delenv(thread_policy.ENV, raising=False)
    monkeypatch.setattr(thread_choice, "measure", lambda *a, **k: pytest.fail("measured"))
    engine = LLMEngine(engine_config(model_dir, draft_model="none"))
    assert engine.threads.how.startswith("defaults (not measured: ")
    assert engine.threads.setup == ThreadSetup.current()


@pytest.mark.slow
def test_every_candidate_gives_the_same_greedy_tokens(restored):
    """The built-in model on the C++ kernels, greedy, under every candidate of a 2- and a
    4-core machine (more threads than cores here): the one-thread tokens, token for token."""
    engine = LLMEngine(EngineConfig(draft_model="none", kernel_tuning=False,
                                    kv_cache_memory=64 << 20, max_model_len=1024))
    prompts = [engine.encode(p) for p in ("The capital of France is",
                                          "def fibonacci(n):\n    ")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def tokens(setup: ThreadSetup) -> list[list[int]]:
        setup.apply()
        return [o.token_ids for o in engine.generate(prompts, params)]

    reference = tokens(ThreadSetup(1))
    assert all(len(t) == 24 for t in reference)
    for setup in dict.fromkeys(candidates(2) + candidates(4)):
        assert tokens(setup) == reference, setup.name
