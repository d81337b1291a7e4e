"""Teacher data at scale: tokens-only shards, multi-turn conversations fed the target's own
answers, resume at the first missing shard, refusal to mix modes, and a train corpus that
never sees a held-out prompt, component or follow-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.cli import main as cli_main
from specserve.core.errors import ConfigError
from specserve.distill import corpus
from specserve.distill.data import (
    Conversation,
    Prompt,
    TeacherData,
    generate_teacher_data,
    load_prompts,
)
from tests.helpers.reference import hf_greedy
from tests.helpers.speculation import make

CONVS = [
    Conversation("a", "chat", "train", ("Tell me about owls.", "Make it shorter.")),
    Conversation("b", "chat", "train", ("What is tea?",)),
    Conversation("c", "list", "train", ("List 3 rivers.", "Add one more.", "Sort them.")),
    Conversation("d", "chat", "train", ("Why is the sky blue?", "Explain it to a child.")),
]


@pytest.fixture(scope="module")
def target(text_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(text_model).float().eval()
    hf.generation_config.pad_token_id = 0
    return text_model, hf


def engine_for(path):
    return make(path, num_kv_blocks=600, max_num_seqs=3, speculative_method="off")


def test_tokens_only_multi_turn_feeds_the_targets_own_answers_back(target, tmp_path):
    path, hf = target
    engine = engine_for(path)
    data = generate_teacher_data(engine, CONVS, tmp_path, max_tokens=12, chunk_size=4,
                                 logprobs=False)
    assert data.top_ids == [] and data.top_logprobs == [] and not data.has_logprobs
    assert data.ids == ["a", "a/t2", "b", "c", "c/t2", "c/t3", "d", "d/t2"]
    tok = engine.tokenizer
    answers: dict[str, str] = {}
    for tokens, p, rid in zip(data.tokens, data.prompt_lens, data.ids):
        conv = next(c for c in CONVS if c.id == rid.split("/")[0])
        turn = int(rid.split("/t")[1]) - 1 if "/t" in rid else 0
        # the prompt: the conversation so far, the target's earlier answers as assistant turns
        messages = []
        for t in range(turn):
            messages += [{"role": "user", "content": conv.turns[t]},
                         {"role": "assistant", "content": answers[f"{conv.id}/{t}"]}]
        messages.append({"role": "user", "content": conv.turns[turn]})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
        assert tokens[:p].tolist() == prompt
        # the answer: transformers' greedy continuation (an EOS may end it early)
        answer = tokens[p:].tolist()
        assert tokens.dtype == torch.int32 and 1 <= len(answer) <= 12
        assert answer == hf_greedy(hf, prompt, len(answer))
        answers[f"{conv.id}/{turn}"] = tok.decode(answer, skip_special_tokens=True)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    # 4 bytes per token of a sequence, plus a small fixed overhead per shard
    shard_bytes = (tmp_path / "shard-00000.pt").stat().st_size
    assert shard_bytes < 4 * sum(len(t) for t in data.tokens) + 4096


def test_resume_regenerates_only_the_missing_shard_and_refuses_other_settings(target, tmp_path):
    path, _ = target
    engine = engine_for(path)
    full = generate_teacher_data(engine, CONVS, tmp_path, max_tokens=8, chunk_size=2,
                                 logprobs=False)
    first = (tmp_path / "shard-00000.pt").read_bytes()
    (tmp_path / "shard-00001.pt").unlink()
    stats: dict = {}
    again = generate_teacher_data(engine, CONVS, tmp_path, max_tokens=8, chunk_size=2,
                                  logprobs=False, stats=stats)
    assert (tmp_path / "shard-00000.pt").read_bytes() == first
    assert stats["shards"] == 1 and stats["sequences"] == sum(i[0] in "cd" for i in full.ids)
    assert again.ids == full.ids
    assert all(torch.equal(a, b) for a, b in zip(again.tokens, full.tokens))
    with pytest.raises(ConfigError, match="other settings"):
        generate_teacher_data(engine, CONVS, tmp_path, max_tokens=8, chunk_size=2)
    with pytest.raises(ConfigError, match="other prompts"):
        generate_teacher_data(engine, CONVS[::-1], tmp_path, max_tokens=8, chunk_size=2,
                              logprobs=False)


def test_token_budget_stops_starting_shards(target, tmp_path):
    path, _ = target
    # one sequence at a time: a window of 2 conversations, so chunks 0 and 1 start together;
    # once shard 0 is written the budget is met and no further chunk starts
    engine = make(path, num_kv_blocks=600, max_num_seqs=1, speculative_method="off")
    data = generate_teacher_data(engine, CONVS, tmp_path, max_tokens=6, chunk_size=1,
                                 logprobs=False, max_response_tokens=1)
    assert sorted(p.name for p in tmp_path.glob("shard-*.pt")) == ["shard-00000.pt",
                                                                   "shard-00001.pt"]
    assert data.ids == ["a", "a/t2", "b"]
    assert not engine.has_unfinished()


def test_logprob_shards_keep_the_distribution_of_each_token(target, tmp_path):
    path, _ = target
    data = generate_teacher_data(engine_for(path), CONVS[:2], tmp_path, max_tokens=6)
    assert data.has_logprobs and len(data.top_ids) == len(data) == 3
    for tokens, p, top, lp in zip(data.tokens, data.prompt_lens, data.top_ids,
                                  data.top_logprobs):
        assert top.shape == lp.shape == (len(tokens) - p, 20)
        assert torch.equal(top[:, 0], tokens[p:])  # greedy: the top token is the one chosen
    mixed = TeacherData.load_dir(tmp_path)
    with pytest.raises(ConfigError, match="mix"):
        mixed.extend(TeacherData([torch.tensor([1, 2], dtype=torch.int32)], [1], ["x"]))


@pytest.mark.slow
def test_corpus_is_large_multi_turn_and_disjoint_from_held_out():
    train = corpus.build_train_corpus(max_turns=3)
    heldout = corpus.heldout_conversations(load_prompts(split="heldout"), max_turns=3)
    assert len(train) > 5000 and len({c.id for c in train}) == len(train)
    assert {len(c.turns) for c in train} == {1, 2, 3}
    assert len({c.category for c in train[:13]}) == 13  # any prefix mixes the categories
    assert [c.id for c in heldout] == [p.id for p in load_prompts(split="heldout")]
    corpus.check_corpus(train, heldout)
    heldout_followup = corpus.followups("chat", "heldout")[0]
    assert heldout_followup not in corpus.followups("chat", "train")
    leaked = [Conversation("x", "chat", "train", ("Hi.", heldout[0].turns[0]))]
    with pytest.raises(AssertionError):
        corpus.check_corpus(leaked, heldout)
    assert corpus.build_train_corpus(max_turns=3)[:50] == train[:50]  # deterministic


@pytest.mark.slow
def test_cli_data_only_writes_tokens_only_shards_and_a_speed_log(text_model, tmp_path):
    prompts = tmp_path / "prompts.json"
    items = [Prompt(f"p{i}", "chat", "heldout" if i >= 3 else "train", f"Say hi {i}.")
             for i in range(4)]
    prompts.write_text(json.dumps([p.__dict__ for p in items]))
    out = tmp_path / "run"
    assert cli_main(["distill", "--data-only", "--no-logprobs", "--target", text_model,
                     "--out", str(out), "--prompts", str(prompts), "--max-new-tokens", "5",
                     "--gen-batch", "2", "--turns", "2", "--corpus", "--num-prompts", "3"]) == 0
    train = TeacherData.load_dir(out / "data" / "train")
    assert not train.has_logprobs and len({i.split("/")[0] for i in train.ids}) == 3
    assert TeacherData.load_dir(out / "data" / "heldout").ids[0] == "p3"
    (record,) = [json.loads(line) for line in (out / "data" / "gen_log.jsonl").open()]
    assert record["train"]["response_tokens"] == train.num_response_tokens > 0
    assert record["train_total"]["sequences"] == len(train)


def test_prompt_files_of_the_old_shape_still_load():
    assert all(isinstance(p, Prompt) for p in load_prompts(Path(corpus.bp.OUT_PATH))[:3])
