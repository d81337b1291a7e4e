"""The C++ kernels' thread pool (kernels/csrc/pool.h): a region ends when its chunks are done,
not when every thread has checked in, and no schedule moves a bit. Checked on the built-in
model's real fused decoder path (prefill, decode and verify rows, the paged attention with and
without key segments) against a one-thread run: with the workers held (as descheduled threads
are), under every wait policy and OpenMP's static split, and while another process burns a core
and a thread wakes every 2 ms (a server's event loop). The kernels let other Python threads run
while they compute (they release the GIL)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from specserve.kernels import quant_ext, thread_policy
from specserve.kernels.attention_form import AVX2, form
from specserve.kernels.thread_policy import ThreadPolicy

ext = quant_ext.load()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def policy(p: ThreadPolicy) -> Iterator[None]:
    before = thread_policy.current()
    thread_policy.apply(p)
    try:
        yield
    finally:
        thread_policy.apply(before)


@contextlib.contextmanager
def held_workers() -> Iterator[None]:
    ext.pool_hold_workers(True)
    try:
        yield
    finally:
        ext.pool_hold_workers(False)


@contextlib.contextmanager
def core_burner() -> Iterator[None]:
    """Another process spinning on a core for as long as the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def default_model():
    from specserve.engine.models import default_model_path
    from specserve.target.loader import build_model
    from specserve.target.quantize import quantize_model

    path = default_model_path()
    cfg, model = build_model(path, torch.float32, "cpu")
    quantize_model(model, "gguf", path)
    return cfg, model


# Two sequences: a 300-token prefill chunk beside a 40-token one, then a decode row beside a
# 5-row verify, then decode rows of both (block size 16, 24 blocks each).
_STEPS = (([300, 40], [300, 40]), ([1, 5], [301, 45]), ([1, 1], [302, 46]))


def _logits(cfg, model, attention_form: int) -> torch.Tensor:
    from specserve.kernels.cpu_paged import CpuPagedAttention
    from specserve.kernels.metadata import AttentionMetadata, token_positions
    from specserve.target.model_runner import ModelRunner

    runner = ModelRunner(cfg, model, num_blocks=48, block_size=16, dtype=torch.float32,
                         device="cpu", attn_backend=CpuPagedAttention(form=attention_form))
    tables = [list(range(24)), list(range(24, 48))]
    g = torch.Generator().manual_seed(0)
    outs = []
    with torch.inference_mode():
        for q_lens, ctx in _STEPS:
            meta = AttentionMetadata.build(q_lens, ctx, tables, 16)
            ids = torch.randint(0, cfg.vocab_size, (sum(q_lens),), generator=g)
            outs.append(runner.forward(ids, token_positions(q_lens, ctx), meta)[0])
    return torch.cat(outs)


# No key segments, and segments of 128 keys (a lone sequence's few KV heads then spread over
# the threads through the pool's longest-first items).
FORMS = (form(AVX2, 8), form(AVX2, 8, 1))


@pytest.fixture(scope="module")
def one_thread(default_model) -> dict[int, torch.Tensor]:
    cfg, model = default_model
    with torch_threads(1):
        return {f: _logits(cfg, model, f) for f in FORMS}


@pytest.mark.slow
@pytest.mark.parametrize("attention_form", FORMS)
def test_a_region_does_not_wait_for_a_worker_that_has_not_started(default_model, one_thread,
                                                                  attention_form):
    """With every worker held before it claims a chunk (a thread the OS has not run yet), the
    step still completes, on the calling thread alone, with the one-thread bits: nobody
    waited for the held workers. Released, they take chunks again; same bits."""
    cfg, model = default_model
    with torch_threads(2), policy(ThreadPolicy()):
        _logits(cfg, model, attention_form)  # workers started
        workers, _, _, by_workers = ext.pool_stats()
        assert workers == 1
        with held_workers():
            held = _logits(cfg, model, attention_form)
            _, regions, by_caller, by_workers_held = ext.pool_stats()
        assert by_workers_held == by_workers  # the held worker ran nothing
        assert torch.equal(held, one_thread[attention_form])
        free = _logits(cfg, model, attention_form)
        _, regions_after, by_caller_after, by_workers_after = ext.pool_stats()
    assert torch.equal(free, one_thread[attention_form])
    assert regions_after > regions and by_caller_after > by_caller
    assert by_workers_after > by_workers  # workers took chunks again once released


@pytest.mark.slow
@pytest.mark.parametrize("p, torch_n", [
    (ThreadPolicy(), 2), (ThreadPolicy(spin_us=-1, wait_us=-1), 2),
    (ThreadPolicy(spin_us=0, wait_us=0), 2), (ThreadPolicy(openmp=True), 2),
    (ThreadPolicy(threads=3), 1)], ids=lambda v: v.name if isinstance(v, ThreadPolicy) else v)
def test_every_wait_policy_gives_the_one_thread_bits(default_model, one_thread, p, torch_n):
    """Polling or sleeping, OpenMP's split, and a team of its own (3 pool threads while
    torch's ops run on 1): the one-thread bits."""
    cfg, model = default_model
    with torch_threads(torch_n), policy(p):
        for f in FORMS:
            assert torch.equal(_logits(cfg, model, f), one_thread[f])
        if p.threads:
            assert ext.pool_stats()[0] == p.threads - 1


@pytest.mark.slow
def test_steps_under_a_burned_core_and_a_waking_thread_are_bit_identical(default_model,
                                                                          one_thread):
    """Another process busy on a core and a thread waking every 2 ms: the OS deschedules the
    kernels' threads mid-step, and chunks land on whichever thread is running. The logits are
    the quiet one-thread run's, bit for bit, on 2 and 3 threads (more threads than cores)."""
    cfg, model = default_model
    with core_burner(), thread_policy.event_loop_stand_in(0.002, 200.0):
        for threads in (2, 3):
            with torch_threads(threads):
                for f in FORMS:
                    assert torch.equal(_logits(cfg, model, f), one_thread[f])


@contextlib.contextmanager
def gil_watch() -> Iterator[Callable[[Callable[[], object]], bool]]:
    """Yields ``ran_beside(call)``: True when another Python thread ran while ``call`` ran.
    The thread ticks a counter between short waits; with the interpreter's switch interval
    set far beyond the test, the GIL changes hands only where its holder lets it go, so the
    counter moves during ``call`` only if ``call`` released the GIL."""
    ticks = [0]
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.0002):
            ticks[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()

    def ran_beside(call: Callable[[], object]) -> bool:
        before = ticks[0]
        call()
        return ticks[0] > before

    try:
        yield ran_beside
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


class _WatchedStack:
    """A DecoderStack whose forward_ records whether another thread ran during it."""

    def __init__(self, stack, ran_beside) -> None:
        self.stack, self.ran_beside, self.beside = stack, ran_beside, []

    def forward_(self, *args) -> None:
        self.beside.append(self.ran_beside(lambda: self.stack.forward_(*args)))

    def __getattr__(self, name: str):
        return getattr(self.stack, name)


@pytest.mark.slow
def test_kernels_let_other_python_threads_run(default_model, one_thread):
    """A block projection and the whole-stack decoder call run without the GIL: a server's
    event loop (another Python thread) can write a stream's chunk while a step computes,
    instead of waiting for the step's end. The ticking thread misses a call when the OS has
    not run it in time, so each kernel must be seen beside it 5 times in up to 400 calls
    (after a warm-up call: a first call's one-time set-up may release the GIL itself); with
    the GIL held it is never seen. The stack's logits stay the one-thread bits."""
    from specserve.kernels.quant import BlockQuantLinear, quantize

    layer = BlockQuantLinear(quantize(torch.randn(2048, 2048) * 0.05, "q8_0"))
    x = torch.randn(32, 2048)
    cfg, model = default_model
    f = FORMS[0]
    layer(x)
    _logits(cfg, model, f)  # builds the model's DecoderStack
    real = model._stack
    assert real is not None
    with torch_threads(2), gil_watch() as ran_beside:
        projection = [ran_beside(lambda: layer(x)) for _ in range(400)]
        model._stack = watched = _WatchedStack(real, ran_beside)
        try:
            while sum(watched.beside) < 5 and len(watched.beside) < 400:
                assert torch.equal(_logits(cfg, model, f), one_thread[f])
        finally:
            model._stack = real
    assert sum(projection) >= 5, sum(projection)
    assert sum(watched.beside) >= 5, (sum(watched.beside), len(watched.beside))


@pytest.mark.e2e
def test_pool_follows_torch_threads():
    """Under a policy with threads=0 the team is torch.get_num_threads(): the caller and n - 1
    workers, resized with it; a policy's threads=k fixes the team at k whatever torch's count.
    (The policy is set here: an engine built earlier in the process may have chosen another.)"""
    x = torch.randn(4, 576)
    from specserve.kernels.quant import BlockQuantLinear, quantize

    layer = BlockQuantLinear(quantize(torch.randn(1536, 576) * 0.05, "q4_1"))
    ref = layer(x)
    with policy(ThreadPolicy()):
        for n in (3, 2, 1):
            with torch_threads(n):
                assert torch.equal(layer(x), ref)
                if n > 1:
                    assert ext.pool_stats()[0] == n - 1
    with policy(ThreadPolicy(threads=3)), torch_threads(1):
        assert torch.equal(layer(x), ref)
        assert ext.pool_stats()[0] == 2


def _policy_in_fresh_process(env_value: str | None) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != thread_policy.ENV}
    if env_value is not None:
        env[thread_policy.ENV] = env_value
    code = "from specserve.kernels import thread_policy as t; print(t.current().name)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.e2e
def test_a_process_starts_with_the_default_or_the_env_policy():
    """The C++ pool's own default is ThreadPolicy()'s; SPECSERVE_THREAD_POLICY replaces it when
    the extension loads (how a server is run under another policy); a malformed value keeps
    the default, with a warning, rather than losing the kernels."""
    assert _policy_in_fresh_process(None) == thread_policy.DEFAULT.name
    assert _policy_in_fresh_process("spin_us=7,wait_us=-1") == "spin_us=7,wait_us=-1"
    assert _policy_in_fresh_process("openmp") == "openmp"
    assert _policy_in_fresh_process("threads=2") == ThreadPolicy(threads=2).name
    assert _policy_in_fresh_process("fast") == thread_policy.DEFAULT.name


def test_policy_round_trip_and_env(monkeypatch):
    for text, want in (("openmp", ThreadPolicy(openmp=True)),
                       ("spin_us=-1, wait_us=0", ThreadPolicy(spin_us=-1, wait_us=0)),
                       ("wait_us=7", ThreadPolicy(wait_us=7)),
                       ("threads=3", ThreadPolicy(threads=3))):
        assert ThreadPolicy.parse(text) == want
        with policy(want):
            assert thread_policy.current() == want
    monkeypatch.setenv(thread_policy.ENV, "spin_us=5")
    assert thread_policy.from_env() == ThreadPolicy(spin_us=5)
    monkeypatch.setenv(thread_policy.ENV, "spin=5")
    with pytest.raises(ValueError, match="SPECSERVE_THREAD_POLICY.*expected 'openmp' or"):
        thread_policy.from_env()
    with pytest.raises(ValueError, match="spin_us must be an integer"):
        ThreadPolicy.parse("spin_us=fast")
    with pytest.raises(ValueError, match=">= 0 microseconds or -1"):
        ThreadPolicy(spin_us=-2)
    with pytest.raises(ValueError, match="threads must be in 0..1024"):
        ThreadPolicy(threads=-1)
    with pytest.raises(RuntimeError, match="must be >= 0 microseconds, or -1"):
        ext.set_thread_policy(-5, 0, False)


@pytest.mark.e2e
@pytest.mark.parametrize("args, message", [
    (["--policies", "spin=3"], "--policies: thread policy 'spin=3': expected 'openmp' or"),
    (["--omp", "lazy"], "--omp takes default, passive, active or VAR=value"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--no-in-process"], "--no-in-process leaves nothing to time without --server"),
])
def test_thread_policy_benchmark_rejects_bad_flags_with_one_line(args, message):
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "thread_policy.py"), *args,
                           "--no-write"], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
