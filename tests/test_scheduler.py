"""Scheduler: token budget, chunked prefill, preemption by recompute, nothing lost or duplicated.

The model is simulated: after each step every scheduled chunk counts as computed and a chunk
that reaches the end of its tokens gets one new (fake) token, as the engine does.
"""

from __future__ import annotations

import random

import pytest

from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams
from specserve.core.sequence import Sequence, SequenceStatus
from specserve.engine.block_manager import BlockManager
from specserve.engine.scheduler import Scheduler


def make(num_blocks, block_size=4, max_num_seqs=8, budget=32, prefix=True):
    cfg = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, enable_prefix_caching=prefix)
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(cfg, bm), bm


def new_seq(i, prompt_len, max_tokens, rng=None):
    toks = [(rng or random).randrange(100) for _ in range(prompt_len)]
    return Sequence(i, str(i), toks, SamplingParams(max_tokens=max_tokens))


def run_to_completion(sched, bm, seqs, max_steps=5000):
    """Simulated engine loop; returns per-step batches and the finish order."""
    for s in seqs:
        sched.add(s)
    finished, steps = [], []
    while sched.has_unfinished():
        assert len(steps) < max_steps, "scheduler made no progress"
        running_before = list(sched.running)
        batch = sched.schedule()
        steps.append(batch)
        if batch.preempted:
            # Newest first: victims come off the end of the running list, in reverse order.
            n = len(batch.preempted)
            assert batch.preempted == running_before[::-1][:n]
        ids = [s.seq.seq_id for s in batch.scheduled]
        assert len(ids) == len(set(ids)), "a sequence was scheduled twice in one step"
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        # Every live sequence is in exactly one queue.
        live = [*sched.waiting, *sched.running]
        assert len(live) == len({id(s) for s in live})
        for s in batch.scheduled:
            seq = s.seq
            assert seq.status == SequenceStatus.RUNNING
            need = seq.num_computed_tokens + s.num_new_tokens
            assert len(seq.block_table) * bm.block_size >= need
            seq.num_computed_tokens += s.num_new_tokens
            if s.samples:
                seq.append_token(7)
            bm.commit_computed(seq)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq)
                finished.append(seq.seq_id)
    return steps, finished


def test_chunked_prefill_mixes_with_decodes():
    sched, bm = make(num_blocks=64, budget=16)
    a = new_seq(0, 5, 10)
    b = new_seq(1, 40, 3)
    steps, finished = run_to_completion(sched, bm, [a, b])
    # The long prompt is fed in chunks no larger than the budget, while `a` keeps decoding.
    chunks = [s.num_new_tokens for st in steps for s in st.scheduled if s.seq is b and s.seq]
    assert max(chunks) <= 16 and sum(chunks[:3]) >= 40 - 16
    mixed = [st for st in steps if {s.seq.seq_id for s in st.scheduled} == {0, 1}]
    assert any(s.num_new_tokens == 1 for st in mixed for s in st.scheduled if s.seq is a)
    assert sorted(finished) == [0, 1]
    assert bm.num_free_blocks == 64


def test_preemption_under_tiny_pool_loses_nothing():
    rng = random.Random(0)
    # 12 blocks of 4 = 48 tokens for 6 sequences that each need up to 20 tokens.
    sched, bm = make(num_blocks=12, budget=24, prefix=False)
    seqs = [new_seq(i, rng.randint(3, 10), rng.randint(5, 10), rng) for i in range(6)]
    steps, finished = run_to_completion(sched, bm, seqs)
    assert sorted(finished) == list(range(6))
    assert any(st.preempted for st in steps), "the pool was meant to force preemption"
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert bm.num_free_blocks == 12


@pytest.mark.parametrize("seed", range(5))
def test_random_workloads_finish_exactly_once(seed):
    rng = random.Random(seed)
    nb = rng.randint(8, 30)
    sched, bm = make(num_blocks=nb, block_size=rng.choice([1, 2, 4]), budget=rng.randint(4, 40),
                     max_num_seqs=rng.randint(1, 6), prefix=rng.random() < 0.5)
    cap = nb * bm.block_size
    seqs = []
    for i in range(rng.randint(1, 12)):
        p = rng.randint(1, max(1, cap // 3))
        seqs.append(new_seq(i, p, rng.randint(1, max(1, cap // 3 - p + 1)), rng))
    steps, finished = run_to_completion(sched, bm, seqs)
    assert sorted(finished) == list(range(len(seqs)))
    assert bm.num_free_blocks == nb


def test_fcfs_admission_order():
    sched, bm = make(num_blocks=64, budget=100, max_num_seqs=2)
    seqs = [new_seq(i, 4, 2) for i in range(4)]
    steps, finished = run_to_completion(sched, bm, seqs)
    assert finished == [0, 1, 2, 3]


def test_lookahead_drops_to_zero_before_anyone_is_preempted():
    """Two decoding sequences asking for 4 lookahead slots each, in a pool with room for their
    next token but not for their drafts: both run with k = 0, nobody is preempted."""
    sched, bm = make(num_blocks=4, block_size=4, budget=32)
    seqs = [new_seq(i, 7, 50) for i in range(2)]  # 7 prompt tokens: 2 blocks each
    for s in seqs:
        sched.add(s)
    sched.schedule()  # prefill both: 4 blocks in use, slot 8 of each still free
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.append_token(1)  # the sampled token; its KV goes in slot 8
        s.num_lookahead_slots = 4  # 4 drafts would need a third block each
    batch = sched.schedule()
    assert not batch.preempted and len(batch.scheduled) == 2
    assert [s.num_lookahead for s in batch.scheduled] == [0, 0]
    assert bm.num_free_blocks == 0


def test_lookahead_of_others_is_returned_before_preempting():
    """The first sequence gets its lookahead block; the second cannot fit even its next token
    until that block is returned: the first's k drops to 0 and nobody is preempted."""
    sched, bm = make(num_blocks=5, block_size=4, budget=32)
    seqs = [new_seq(0, 7, 50), new_seq(1, 8, 50)]  # 2 blocks each; seq 1's block 2 is full
    for s in seqs:
        sched.add(s)
    sched.schedule()
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.append_token(1)
        s.num_lookahead_slots = 4
    batch = sched.schedule()
    assert not batch.preempted and len(batch.scheduled) == 2
    assert [s.num_lookahead for s in batch.scheduled] == [0, 0]
    assert len(seqs[0].block_table) == 2 and len(seqs[1].block_table) == 3
