"""Structured outputs: outputs match their schema / regex / choice (validated with jsonschema and
``re``, implementations independent of the grammar engine), greedy constrained output is
token-identical with every proposer and with speculation off, sampling follows the masked
distribution (chi-square), and bad constraints are a 400 naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch

from specserve.core.config import EngineConfig
from specserve.core.errors import InvalidRequestError
from specserve.core.sampling import SampleRequest, apply_token_bitmask
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.core.structured import StructuredSpec
from specserve.engine.llm_engine import LLMEngine
from specserve.server.server_config import ServerConfig
from specserve.spec.rejection_sampler import SpecDecodeRow, rejection_sample
from tests.helpers.servers import KEY, NAME, ServerThread, engine_config, http

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "n", "ok", "color", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@[a-z]{1,4}\.com"
CHOICES = ["yes", "no", "maybe"]
PROMPTS = ["Hello there", "Write JSON about a b c d a b c d", "1 2 3 1 2 3 1 2 3"]


def _specs() -> list[StructuredSpec]:
    return [StructuredSpec.json_schema(SCHEMA, "s"), StructuredSpec("json_object", "", "j"),
            StructuredSpec("regex", REGEX, "r"), StructuredSpec.choice(CHOICES, "c")]


def _check(spec: StructuredSpec, text: str, finish_reason: str) -> None:
    """A finished answer matches its constraint (checked without the grammar engine). The
    bounded constraints (this schema, regex, choice) always finish within the test's budget; a
    random tiny model under json_object (any keys, any strings) may run out of tokens first,
    and then there is nothing to parse yet (the default model's test parses its objects)."""
    if spec.kind == "json_object" and finish_reason == "length":
        return
    assert finish_reason == "stop", (spec.kind, text)
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES


@pytest.fixture(scope="module")
def engines(model_dir, text_model):
    """The tiny target with a draft model of the same vocabulary (``text_model``), so every
    proposer can run: ngram, suffix, draft, auto."""
    return LLMEngine(engine_config(model_dir, draft_model=text_model,
                                   adaptive_speculation=False, num_speculative_tokens=4))


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "auto"])
def test_greedy_constrained_identical_to_plain(engines, method):
    engine = engines
    for spec in _specs():
        params = SamplingParams(max_tokens=60, temperature=0.0, structured=spec)
        plain = engine.generate(PROMPTS, params, SpeculativeParams(method="off"))
        spec_out = engine.generate(PROMPTS * 2, params, SpeculativeParams(method=method))
        for i, out in enumerate(spec_out):
            ref = plain[i % len(PROMPTS)]
            assert out.token_ids == ref.token_ids, (method, spec.kind, i)
            _check(spec, out.text, out.finish_reason)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_drafts_cut_before_verify(engines):
    """A proposer that drafts what the grammar forbids gets its drafts cut (none of them is
    verified) and the answer is unchanged."""
    engine = engines
    spec = StructuredSpec.choice(CHOICES, "c")
    params = SamplingParams(max_tokens=10, temperature=0.0, structured=spec)
    # the prompt repeats text the grammar can never produce, so n-gram drafts are rejected
    prompt = "zzz qqq zzz qqq zzz qqq zzz qqq zzz"
    plain = engine.generate([prompt], params, SpeculativeParams(method="off"))[0]
    out = engine.generate([prompt], params, SpeculativeParams(method="ngram"))[0]
    assert out.token_ids == plain.token_ids and out.text in CHOICES
    assert out.timings.num_drafted <= len(out.token_ids)  # only grammar-valid drafts verified


def test_forced_drafts_come_from_the_grammar(engines):
    """Where the proposer has nothing, the grammar's forced text (keys, punctuation) is drafted:
    more drafts than without it, the same answer."""
    engine = engines
    spec = StructuredSpec.json_schema(SCHEMA, "s")
    params = SamplingParams(max_tokens=60, temperature=0.0, structured=spec)
    plain = engine.generate(PROMPTS, params, SpeculativeParams(method="off"))
    planner = engine.speculator.planner
    drafted = {}
    try:
        for forced in (True, False):
            planner.forced_draft = engine.speculator._forced_draft if forced else None
            outs = engine.generate(PROMPTS, params, SpeculativeParams(method="ngram"))
            assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
            drafted[forced] = sum(o.timings.num_drafted for o in outs)
    finally:
        planner.forced_draft = engine.speculator._forced_draft
    assert drafted[True] > drafted[False], drafted


def test_grammar_state_masks_rows_and_rolls_back(engines):
    """prepare() masks row j after drafts 0..j-1 and cuts at the first rejected draft;
    commit() keeps exactly the accepted tokens (the matcher then accepts what follows)."""
    engine = engines
    spec = StructuredSpec.choice(["abc", "abd"], "c")
    compiled = engine.grammar_compiler.compile(spec)
    from specserve.spec.grammar import GrammarState

    tok = engine.tokenizer
    ids = tok.encode("abc", add_special_tokens=False)
    g = GrammarState.start(compiled, engine.model_config.vocab_size, engine._encode_text)
    bad = tok.encode("x", add_special_tokens=False)
    kept, masks = g.prepare(ids + bad + ids)
    assert kept == len(ids) and masks.shape[0] == kept + 1
    logits = torch.zeros(masks.shape[0], engine.model_config.vocab_size)
    allowed = ~torch.isinf(apply_token_bitmask(logits, masks))
    for j, t in enumerate(ids):
        assert allowed[j, t]  # each kept draft allowed by its own row
    assert not allowed[len(ids), bad[0]]
    g.commit(ids[:0] + [ids[0]], 0)  # the target kept none of them and emitted ids[0]
    kept2, _ = g.prepare(ids[1:])
    assert kept2 == len(ids) - 1


def test_sampled_constrained_outputs_match(engines):
    engine = engines
    for spec in _specs()[::2] + _specs()[3:]:  # schema, regex, choice
        params = SamplingParams(max_tokens=48, temperature=1.0, seed=3, structured=spec)
        for method in ("off", "ngram", "draft"):
            for out in engine.generate(PROMPTS[:2], params, SpeculativeParams(method=method)):
                if out.finish_reason == "stop":
                    _check(spec, out.text, out.finish_reason)
                else:  # a sampled string may run long; what there is must still be a prefix
                    assert out.finish_reason == "length"


def test_bad_constraints_name_their_field(engines):
    engine = engines
    bad = [StructuredSpec("json_schema", '{"type": "foo"}', "response_format.json_schema.schema"),
           StructuredSpec("regex", "a(b", "structured_outputs.regex"),
           StructuredSpec("grammar", "root ::= undefined_rule", "structured_outputs.grammar")]
    for spec in bad:
        with pytest.raises(InvalidRequestError) as err:
            engine.generate(["x"], SamplingParams(max_tokens=4, structured=spec))
        assert err.value.param == spec.param
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(min_tokens=2, structured=_specs()[0])
    assert err.value.param == "min_tokens"


# ---- the masked distribution: chi-square ---------------------------------------------------

CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47}  # chi-square quantile 0.999 by degrees of freedom


def _bitmask(allowed: list[int], vocab: int) -> torch.Tensor:  # [1, W]
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)[None, :]


@pytest.mark.parametrize("with_q", [True, False])
def test_sampling_follows_the_masked_distribution(with_q):
    """Rows with two drafts (from a draft distribution q, or deterministic): the first emitted
    token follows softmax(target logits) restricted to the grammar's allowed set."""
    torch.manual_seed(0)
    vocab, n = 8, 20000
    allowed = [1, 3, 5, 6]
    logits = torch.randn(vocab)
    mask = _bitmask(allowed, vocab)  # [1, W]
    want = torch.full((vocab,), float("-inf"))
    want[allowed] = logits[allowed]
    want = want.softmax(-1)
    q = torch.randn(vocab).softmax(-1)
    gen = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q, 2 * n, replacement=True, generator=gen).view(n, 2).tolist()
    req = SampleRequest(SamplingParams(temperature=1.0), 0, None, [])
    rows = [SpecDecodeRow(req, d, mask.expand(3, -1).clone()) for d in drafts]
    res = rejection_sample(logits.expand(3 * n, -1).clone(), rows,
                           q.expand(2 * n, -1).clone() if with_q else None, gen)
    first = torch.tensor([t[0] for t in res.token_ids])
    counts = torch.bincount(first, minlength=vocab).double()
    assert counts[[t for t in range(vocab) if t not in allowed]].sum() == 0
    expected = want[allowed].double() * n
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[len(allowed) - 1], (chi2, counts[allowed], expected)


def test_apply_token_bitmask_matches_a_boolean_mask():
    vocab = 70  # not a multiple of 32: the last word is partial
    allowed = [0, 31, 32, 33, 63, 64, 69]
    logits = torch.randn(1, vocab)
    out = apply_token_bitmask(logits.clone(), _bitmask(allowed, vocab))
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[allowed] = True
    assert torch.equal(out[0, keep], logits[0, keep])
    assert torch.isinf(out[0, ~keep]).all()


# ---- the default model ----------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_schema_outputs_validate():
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"], "additionalProperties": False}
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=512))
    prompt = engine.render_chat([{"role": "user", "content":
                                  "Return a JSON object with keys name, age and city for Bob, "
                                  "31, from Paris."}])
    params = SamplingParams(max_tokens=80, temperature=0.0,
                            structured=StructuredSpec.json_schema(schema, "s"))
    obj = SamplingParams(max_tokens=80, temperature=0.0,
                         structured=StructuredSpec("json_object", "", "j"))
    plain = engine.generate([prompt, prompt], [params, obj], SpeculativeParams(method="off"))
    assert [o.finish_reason for o in plain] == ["stop", "stop"]
    jsonschema.validate(json.loads(plain[0].text), schema)
    assert isinstance(json.loads(plain[1].text), dict)
    for method in ("ngram", "suffix", "draft", "auto"):
        outs = engine.generate([prompt, prompt], [params, obj], SpeculativeParams(method=method))
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], method


# ---- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_dir, text_model):
    srv = ServerThread(engine_config(model_dir, draft_model=text_model, speculative_method="auto",
                                     adaptive_speculation=False),
                       ServerConfig(port=0, api_key=KEY, served_model_name=NAME))
    yield srv
    srv.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["off", "ngram", "suffix", "draft", "auto"])
def test_server_response_format_and_structured_outputs(server, method):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    msgs = [{"role": "user", "content": "Give me JSON."}]
    spec_field = {"speculative": {"method": method}}
    formats = {
        "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "thing", "schema": SCHEMA, "strict": True}}},
        "json_object": {"response_format": {"type": "json_object"}},
        "regex": {"extra_body": {"structured_outputs": {"regex": REGEX}}},
        "choice": {"extra_body": {"structured_outputs": {"choice": CHOICES}}},
    }
    for kind, fields in formats.items():
        extra = {**fields.get("extra_body", {}), **spec_field}
        rf = fields.get("response_format", openai.NOT_GIVEN)
        got = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=60,
                                             temperature=0, response_format=rf, extra_body=extra)
        text = got.choices[0].message.content
        spec = {"json_schema": StructuredSpec.json_schema(SCHEMA, "s"),
                "json_object": StructuredSpec("json_object", "", "j"),
                "regex": StructuredSpec("regex", REGEX, "r"),
                "choice": StructuredSpec.choice(CHOICES, "c")}[kind]
        _check(spec, text, got.choices[0].finish_reason)
        chunks = list(client.chat.completions.create(
            model=NAME, messages=msgs, max_tokens=60, temperature=0, response_format=rf,
            extra_body=extra, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    # completions take the same fields
    got = client.completions.create(model=NAME, prompt="x", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"choice": CHOICES},
                                                **spec_field})
    assert got.choices[0].text in CHOICES


@pytest.mark.e2e
@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
])
def test_server_bad_constraint_400(server, fields, param):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **fields}
    status, reply = http("POST", server.url + "/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
