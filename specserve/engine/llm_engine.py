"""LLMEngine: schedule -> propose -> build layout -> forward -> verify -> commit.

The engine owns the request table; the scheduler owns the queues; the block manager owns the KV
blocks; the model runner owns the weights and the KV tensors; the speculator owns everything
speculative (through plan / propose / verify / commit, it names no proposer). ``step()`` is the
whole loop body and is synchronous; the server drives it from a dedicated thread.

The engine is built from one ``ResolvedConfig`` (``self.config``), which the resolver derives
from the ``EngineConfig`` asked for without writing into it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from specserve.core.batch import ScheduledBatch
from specserve.core.config import EngineConfig
from specserve.core.errors import InvalidRequestError
from specserve.core.logits_processors import LogitsState
from specserve.core.sampling import SampleRequest
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.core.sequence import Sequence
from specserve.draft.registry import REGISTRY, ProposerRegistry
from specserve.engine.assembly import build_parts
from specserve.engine.output_processor import RequestState
from specserve.engine.outputs import OutputMerger, RequestOutput
from specserve.engine.prebuild import start_builds
from specserve.engine.resolve import ModelFiles, resolve_config, resolve_device
from specserve.engine.tokenizer import IncrementalDetokenizer, apply_chat_template
from specserve.engine.tracing import NullTracer, Tracer
from specserve.spec.grammar import GrammarState
from specserve.spec.grammar_compiler import GrammarCompiler
from specserve.spec.speculator import Drafts, Verified
from specserve.target.layout import Chunk, build_layout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _StepClock:
    """perf_counter marks of one step: its start, drafts done, forward done, sampling done."""

    start: float
    drafted: float
    model: float
    sampled: float


class LLMEngine:
    def __init__(self, config: EngineConfig, registry: ProposerRegistry = REGISTRY) -> None:
        """``registry``: the proposers it may build (a new method is one more entry)."""
        started = time.perf_counter()  # the start's deadline counts from here (assembly.py)
        if resolve_device(config.device).type == "cpu":
            start_builds()  # a first start's C++ builds run while the model files are read
        files = ModelFiles.open(config)
        self.config = resolve_config(config, files, registry)
        self.tracer: Tracer | NullTracer = NullTracer()  # a Tracer records phase spans
        parts = build_parts(self.config, files, registry, started)
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.runner = parts.runner
        self.block_manager = parts.block_manager
        self.scheduler = parts.scheduler
        self.speculator = parts.speculator
        self.eos_token_ids = parts.eos_token_ids
        self.kernel_table = parts.kernel_table
        self.threads = parts.threads
        if parts.draft is not None and parts.draft.traced is not None:
            # One span per draft forward (each draft step) without touching the proposer.
            parts.draft.traced.register_forward_pre_hook(
                lambda *_: self.tracer.begin("draft_forward"))
            parts.draft.traced.register_forward_hook(lambda *_: self.tracer.end())
        # structured outputs: compiled grammars for this tokenizer, cached by schema text
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                sorted(self.eos_token_ids))
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        log.info("engine ready: %s attention_form=%s; %s", self.config.summary(),
                 getattr(self.attn_backend, "form", "-"), self.threads.describe())

    # What the resolver decided, under the names the engine has always answered to.
    @property
    def device(self) -> torch.device:
        return self.config.device

    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.config.kv_cache_dtype

    @property
    def model_path(self) -> str:
        return self.config.model_path

    @property
    def quantization(self) -> str:
        return self.config.quantization

    @property
    def attn_backend(self):
        return self.runner.attn_backend

    # ---- requests -----------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer; pass the prompt as token ids", param="prompt"
                )
            with self.tracer.span("tokenize", chars=len(prompt)):
                return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        with self.tracer.span("chat_template"):
            return apply_chat_template(self.tokenizer, messages, tools=tools)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        speculative: SpeculativeParams | None = None,
    ) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        ids = self.encode(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {vocab}) for this model", param="prompt"
            )
        if len(ids) >= self.config.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(ids)} tokens, but the context window (max-model-len) is "
                f"{self.config.max_model_len}: shorten the prompt or raise --max-model-len",
                param="prompt", code="context_length_exceeded",
            )
        params.validate()
        params.check_vocab(vocab)
        grammar = None
        if params.structured is not None:  # the async engine compiled it already: a cache hit
            compiled = self.grammar_compiler.compile(params.structured)
            grammar = GrammarState.start(compiled, self.model_config.vocab_size, self._encode_text)
        speculative, prediction = self._prediction(speculative, len(ids))
        seq = Sequence(next(self._seq_ids), request_id, ids, params)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        method = self.speculator.add(seq, speculative, grammar)  # raises for a bad method
        state = RequestState(seq, detok, self.eos_token_ids, self.config.max_model_len, generator,
                             LogitsState.of(params, ids, vocab, self.device),
                             prediction=prediction)
        state.timings.speculative_method = method
        if method != "off":
            state.timings.warning = self.config.speculation_caveat
        self.requests[request_id] = state
        self.scheduler.add(seq)

    def _prediction(self, speculative: SpeculativeParams | None, num_prompt_tokens: int
                    ) -> tuple[SpeculativeParams | None, list[int] | None]:
        """(the speculation with its prediction as token ids, those ids); raises
        ``InvalidRequestError`` naming ``prediction`` for one the context cannot hold."""
        if speculative is None or speculative.prediction is None:
            return speculative, None
        ids = self.encode(speculative.prediction)
        vocab = self.model_config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InvalidRequestError(
                f"prediction token ids must be in [0, {vocab}) for this model",
                param="prediction")
        room = self.config.max_model_len - num_prompt_tokens
        if len(ids) > room:
            raise InvalidRequestError(
                f"prediction is {len(ids)} tokens, but the context window (max-model-len "
                f"{self.config.max_model_len}) leaves {room} for the answer after the "
                f"{num_prompt_tokens}-token prompt: shorten the prediction or the prompt, or "
                "raise --max-model-len", param="prediction")
        return replace(speculative, prediction=ids), ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels a request; its KV blocks return to the pool at once. Returns its final output
        (finish_reason "abort"), or None if it is unknown or already finished."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish(state.seq)
        self.speculator.forget(state.seq)
        state.abort()
        return state.make_output()

    def clear_speculation_caches(self, tenant: str | None = None) -> None:
        """Empties what proposers learned across requests (one tenant's part, or all)."""
        self.speculator.clear_caches(tenant)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> propose -> build layout -> forward -> verify -> commit."""
        spec, tr = self.speculator, self.tracer
        t_start = time.perf_counter()  # the policy's own cost counts in the measured step
        with tr.span("schedule"):
            spec.plan(self.scheduler.running)
            batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        rows = {s.seq.seq_id: self._sample_request(s.seq) for s in batch.scheduled if s.samples}
        drafts = spec.propose(batch, rows, tr.span)
        t_drafted = time.perf_counter()
        with tr.span("target_forward", only_decode=batch.is_decode_only,
                     drafts=drafts.num_tokens):
            layout = build_layout(_target_chunks(batch, drafts), self.config.block_size,
                                  self.device)
            features = spec.features_wanted(batch, layout)
            logits = self.runner.run(layout, features)
        t_model = time.perf_counter()
        with tr.span("sample", drafts=drafts.num_tokens):  # rejection sampling of the drafts
            results = spec.verify(batch, layout, logits, rows, drafts, features)
        t_sample = time.perf_counter()
        spec.record_step(layout.num_tokens, t_sample - t_drafted)
        outputs = self._commit(batch, drafts, results,
                               _StepClock(t_start, t_drafted, t_model, t_sample))
        # Stop checks, detokenization, bookkeeping; then the whole step around every span.
        tr.add("output", t_sample, time.perf_counter())
        tr.add("step", t_start, time.perf_counter(), seqs=len(batch.scheduled))
        return outputs

    def _commit(self, batch: ScheduledBatch, drafts: Drafts, results: dict[int, Verified],
                clock: _StepClock) -> list[RequestOutput]:
        """Per scheduled sequence: its timings, its new tokens (stops cut them where plain
        decoding would), its computed-token count (written once), then its KV blocks: the full
        ones enter the prefix cache, whole blocks past a rejected draft go back to the pool."""
        outputs: list[RequestOutput] = []
        for s in batch.scheduled:
            seq = s.seq
            state = self.requests[seq.request_id]
            t = state.timings
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = clock.start
                t.num_cached_prompt_tokens = seq.num_cached_tokens
            forward_ms = (clock.model - clock.drafted) * 1e3
            if seq.is_prefill:
                t.prefill_ms += forward_ms
            else:
                t.decode_ms += forward_ms
            verified = results.get(seq.seq_id)
            if verified is None:  # a prefill chunk short of the prompt's end
                seq.num_computed_tokens += s.num_new_tokens
                self.block_manager.commit_computed(seq)
                continue
            n_before = seq.num_tokens
            t.sample_ms += (clock.sampled - clock.model) * 1e3
            if verified.num_drafts:
                t.draft_ms += drafts.draft_seconds * 1e3
                t.num_drafted += verified.num_drafts
                t.num_accepted += verified.num_accepted
                t.num_verify_steps += 1
            if seq.timings.first_token is None:
                seq.timings.first_token = clock.sampled
            state.append(verified.token_ids, verified.logprobs, verified.num_accepted)
            if state.logits_state is not None:  # penalties count what was kept, once
                state.logits_state.add(seq.token_ids[n_before:])
            # KV is valid for the fed tokens up to the last accepted draft (rejection_sampler),
            # and never past the last token, which the next step feeds.
            seq.num_computed_tokens = min(n_before + verified.num_accepted, seq.num_tokens - 1)
            self.speculator.commit(seq, verified)
            if not seq.is_finished and self.speculator.grammar_done(seq):
                state.finish_structured()  # the grammar is complete (its EOS under ignore_eos)
            if seq.is_finished:
                # Its full blocks enter the prefix cache before they are freed: a request that
                # ends on its first step (max_tokens=1) would otherwise cache none of its prompt.
                self.block_manager.commit_computed(seq)
                self.scheduler.finish(seq)
                self.speculator.forget(seq)
                self.requests.pop(seq.request_id)
            else:
                # Rejected drafts: slots past the new end are overwritten later; whole blocks
                # past it go back to the pool now.
                self.block_manager.truncate(seq, seq.num_tokens)
                self.block_manager.commit_computed(seq)
            outputs.append(state.make_output())
        return outputs

    def _sample_request(self, seq: Sequence) -> SampleRequest:
        params = seq.params
        banned: list[int] = []
        if params.min_tokens:
            banned = [*self.eos_token_ids, *params.stop_token_ids]
        return SampleRequest(
            params=params,
            num_output_tokens=seq.num_output_tokens,
            generator=self.requests[seq.request_id].generator,
            banned_until_min_tokens=banned,
            logits_state=self.requests[seq.request_id].logits_state,
        )

    # ---- offline API --------------------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        speculative: SpeculativeParams | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion with continuous batching; complete outputs (all text,
        token ids and logprobs) in prompt order."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("give one SamplingParams per prompt, or one for all")
        ids = [f"offline-{next(self._seq_ids)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p, speculative)
        # Each step emits deltas; the offline API returns whole answers.
        merged = {rid: OutputMerger() for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in merged:
                    merged[out.request_id].add(out)
        return [m.take() for m in merged.values()]  # type: ignore[misc]


def _target_chunks(batch: ScheduledBatch, drafts: Drafts) -> list[Chunk]:
    """The target's part of the step: each scheduled sequence feeds its new tokens (a prefill
    chunk, or its last token) plus its drafts; a sequence that samples wants logits for its
    last fed token and every draft (k + 1 rows), a prefill chunk short of the end none."""
    chunks = []
    for s in batch.scheduled:
        seq, start = s.seq, s.seq.num_computed_tokens
        extra = drafts.tokens.get(seq.seq_id, [])
        fed = seq.token_ids[start : start + s.num_new_tokens]
        if extra:
            fed = fed + extra
        chunks.append(Chunk(fed, start, seq.block_table, len(extra) + 1 if s.samples else 0))
    return chunks
