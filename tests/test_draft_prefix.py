"""The draft model's KV on the prefix cache: a hit reuses the draft's KV for blocks a draft-running
request wrote, recomputes it for blocks a plain request filled, and never feeds the draft more
tokens in one forward than ``max_num_batched_tokens``.

The target is its own draft here, so every draft is accepted exactly when the draft's KV is right:
one stale or missing block would show as a rejected draft. Outputs are checked against
transformers' greedy generate on the same weights.
"""

from __future__ import annotations

from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from tests.helpers.reference import prompts
from tests.helpers.speculation import check_greedy, make

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PLAIN = SpeculativeParams(method="off")


def draft_forward_sizes(engine) -> list[int]:
    """Records the tokens fed to each forward of the engine's draft model from now on."""
    runner = engine.speculator.draft.runner
    sizes: list[int] = []
    forward = runner.forward

    def counted(input_ids, *args, **kwargs):
        sizes.append(len(input_ids))
        return forward(input_ids, *args, **kwargs)

    runner.forward = counted
    return sizes


def all_accepted(outs) -> bool:
    return all(o.timings.num_drafted > 0 and o.timings.num_accepted == o.timings.num_drafted
               for o in outs)


def test_hit_reuses_draft_kv_only_where_the_draft_wrote_it(models):
    target, _, hf = models
    engine = make(target, draft_model=target)
    prompt = prompts([41], seed=21)  # 10 full blocks of 4 can hit, 1 token left to run
    sizes = draft_forward_sizes(engine)

    check_greedy(engine, hf, prompt, PARAMS, speculative=PLAIN)  # fills blocks, no draft KV
    assert sizes == []

    first = check_greedy(engine, hf, prompt, PARAMS)  # hits 40 tokens of target KV only
    assert engine.block_manager.prefix_hits == 40
    assert engine.block_manager.draft_prefix_hits == 0
    assert all_accepted(first)  # the draft recomputed the 40 tokens: its KV is right
    fed_first = sum(sizes)
    sizes.clear()

    second = check_greedy(engine, hf, prompt, PARAMS)  # the draft's KV is cached now too
    assert engine.block_manager.draft_prefix_hits == 40
    assert all_accepted(second)
    assert sum(sizes) == fed_first - 40  # exactly the reused tokens are not fed again
    assert [o.token_ids for o in second] == [o.token_ids for o in first]


def test_draft_catch_up_is_bounded_by_the_token_budget(models):
    target, _, hf = models
    budget = 9
    engine = make(target, draft_model=target, max_num_batched_tokens=budget)
    long_prompt = prompts([41], seed=22)
    sizes = draft_forward_sizes(engine)
    check_greedy(engine, hf, long_prompt, PARAMS, speculative=PLAIN)
    # A hit on 40 tokens without draft KV: the target runs 1 token, the draft must catch up 40.
    outs = check_greedy(engine, hf, long_prompt + prompts([23], seed=23), PARAMS)
    assert sizes and max(sizes) <= budget
    assert all_accepted(outs)
    engine.block_manager.check_invariants()
