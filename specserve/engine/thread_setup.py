"""An engine's thread setup at start-up: torch's thread count and the kernels' pool policy, as
the user fixed them, else chosen by timing a one-token decode forward of the loaded model under
each candidate (kernels/thread_choice.py: quiet and beside a waking thread, the server's event
loop's stand-in; within a few seconds; cached per machine and model shape beside the kernel
table, so a later start applies it untimed).

The probe is a decode step as the engine runs it: the forward, then the engine's own sampler
over the logits row (``rejection_sample`` on the ``torch.cat`` the speculator hands it). A
probe that picked the token with one ``argmax`` timed torch's ops on the team as fast as on
one thread (2-core Zen 3: 10.4-11.3 ms both), while the engine's steps ran 1.4x slower with
them on the team (16.8-20.0 ms against 10.5-12.9; plain decoding 60 against 86 tok/s): the
sampler's torch ops wake torch's OpenMP workers, which then spin beside the kernels' pool
through the next forward. With the sampler in the probe it measures that too (17-19 ms
against 11.6-13).

Not measured, and why:

- the user fixed them (``SPECSERVE_THREAD_POLICY``, or ``--num-threads 1``: the resolver
  names which), or asked for no start-up timing (``--no-kernel-tuning``). ``--num-threads N``
  (N > 1) fixes the kernels' team only: where torch's own ops run beside it, and the pool's
  waits, are still measured, among the candidates with that team;
- a device other than the CPU (the kernels' pool runs CPU kernels only);
- a model of fewer than ``MIN_MEASURED_PARAMS`` projection weights (the tests' tiny models,
  at most a few million): its decode step is a few hundred microseconds of per-op dispatch in
  which the kernels' ranges mostly fit one chunk and run on the calling thread, so the
  candidates differ in noise, not in kernel time, and a test run would pay the timing on every
  new model shape. The smallest model users run (the built-in 135M) is well above it.

The setup is process-wide (torch's threads and the pool are), so the last engine built in a
process sets it for every engine there. The kernel table is tuned before the choice, under
torch's own thread count: the table's candidates are forms of one arithmetic, so a choice made
under another team can only cost speed, and a start that keeps the cached setup keeps the
cached table.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import torch

from specserve.core.paths import cache_root
from specserve.core.sampling import SampleRequest
from specserve.core.sampling_params import SamplingParams
from specserve.engine.resolve import ResolvedConfig
from specserve.kernels import quant_ext, thread_choice, thread_policy
from specserve.kernels.metadata import AttentionMetadata, token_positions
from specserve.kernels.thread_choice import ThreadChoice, ThreadSetup
from specserve.kernels.tuner import model_groups, projection_params, shapes_key
from specserve.spec.rejection_sampler import SpecDecodeRow, rejection_sample
from specserve.target.model_runner import ModelRunner

MIN_MEASURED_PARAMS = 16_000_000  # projection weights; the module docstring says why
PROBE_CONTEXT = 128  # tokens of context the probe's decode row attends to
PROBE = "decode forward + sampler"  # in the cache key: a choice timed by another probe is redone


def choose_threads(config: ResolvedConfig, runner: ModelRunner, *,
                   budget_s: float = thread_choice.DEFAULT_BUDGET_S,
                   clock: Callable[[], float] = time.perf_counter) -> ThreadChoice:
    """The setup this engine runs under, applied (module docstring)."""
    if config.device.type != "cpu":  # torch's threads only feed the GPU here
        return ThreadChoice(ThreadSetup(torch.get_num_threads()),
                            f"not measured (device {config.device})")
    policy = thread_policy.from_env()
    team = config.num_threads  # fixed by --num-threads; 0: measured too
    if config.threads_fixed_by is not None and (policy is not None or team <= 1):
        # The extension applies the variable's policy when it loads; one loaded before (an
        # earlier engine in this process) gets it, or a team that follows --num-threads, here.
        if policy is None:
            policy = dataclasses.replace(thread_policy.in_force(), threads=0)
        if quant_ext.loaded():
            thread_policy.apply(policy)
        return ThreadChoice(ThreadSetup.current(), f"fixed by {config.threads_fixed_by}")
    fixed = ""
    if team:  # the team follows --num-threads until a measured placement says otherwise
        fixed = f"team fixed by --num-threads {team}, "
        if quant_ext.loaded():
            thread_policy.apply(dataclasses.replace(thread_policy.in_force(), threads=0))
    if not config.kernel_tuning:
        return ThreadChoice(ThreadSetup.current(), f"{fixed}defaults (--no-kernel-tuning)")
    groups = model_groups(runner.model)
    params = projection_params(groups)
    if params < MIN_MEASURED_PARAMS:
        return ThreadChoice(ThreadSetup.current(), f"{fixed}defaults (not measured: "
                                                   f"{params / 1e6:.1f}M projection weights, "
                                                   f"under {MIN_MEASURED_PARAMS / 1e6:.0f}M)")
    # --num-threads N fixes the team; where torch's own ops run beside it is still measured
    # (2-core Zen 3, a decode step of the built-in model: torch's ops on the team 18.1 ms,
    # on one thread 11.5 ms; torch's OpenMP workers spin after each op, beside the pool's).
    setups = (thread_choice.team_candidates(team) if team
              else thread_choice.candidates(thread_choice.usable_cores()))
    path = thread_choice.cache_path(cache_root() / "tune", _shape_key(config, runner, groups),
                                    setups)
    step, reset = decode_probe(runner)
    try:
        choice = thread_choice.choose(step, path, setups, budget_s=budget_s, clock=clock)
    finally:
        reset()
    return dataclasses.replace(choice, how=fixed + choice.how) if fixed else choice


def _shape_key(config: ResolvedConfig, runner: ModelRunner, groups: dict) -> str:
    mc = runner.model_config
    return "|".join([
        shapes_key(groups), f"heads {mc.num_heads}/{mc.num_kv_heads}x{mc.head_dim}",
        f"vocab {mc.vocab_size}", config.attention_backend,
        str(getattr(runner.attn_backend, "form", "-")), str(config.kv_cache_dtype),
        f"block {runner.block_size}", PROBE,
    ])


def decode_probe(runner: ModelRunner) -> tuple[Callable[[], object], Callable[[], None]]:
    """(step, reset): ``step`` is one decode row of a sequence of ``PROBE_CONTEXT`` tokens
    through ``runner``, then a greedy token from it through the engine's sampler, as the
    speculator runs it for a plain decode row (module docstring: why not a bare argmax); it
    writes one token's KV into the first blocks of the pool, which no request holds yet.
    ``reset`` zeroes them again (the pool starts zeroed: ModelRunner's invariant)."""
    bs = runner.block_size
    context = max(1, min(PROBE_CONTEXT, runner.num_blocks * bs))
    blocks = list(range(math.ceil(context / bs)))
    meta = AttentionMetadata.build([1], [context], [blocks], bs, runner.device)
    ids = torch.zeros(1, dtype=torch.int64)  # [1]
    positions = token_positions([1], [context])  # [1]
    rows = torch.zeros(1, dtype=torch.int64)  # [1]: the one logits row
    greedy = [SpecDecodeRow(SampleRequest(SamplingParams(temperature=0.0), 1, None, []), [])]

    def step() -> list[list[int]]:
        logits, _ = runner.forward(ids, positions, meta, rows)  # [1, vocab]
        return rejection_sample(torch.cat([logits[0:1]]), greedy, None).token_ids

    def reset() -> None:
        runner.kv_cache[:, :, : len(blocks)].zero_()  # [L, 2, blocks, block_size, KVH, D]

    return step, reset
