"""LLMEngine: schedule -> run the model on one flattened batch -> sample -> post-process.

The engine owns the request table; the scheduler owns the queues; the block manager owns the KV
blocks; the model runner owns the weights and the KV tensors. ``step()`` is the whole loop body
and is synchronous; the server drives it from a dedicated thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable

import torch

from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError, InvalidRequestError
from specserve.core.paths import cache_root
from specserve.core.sampling import SampleRequest
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.core.sequence import Sequence
from specserve.draft.eagle_head import EagleHead, EagleRunner, is_eagle_dir, load_head
from specserve.engine.block_manager import BlockManager
from specserve.engine.output_processor import RequestState
from specserve.engine.outputs import OutputMerger, RequestOutput
from specserve.engine.scheduler import ScheduledBatch, Scheduler
from specserve.engine.tokenizer import IncrementalDetokenizer, apply_chat_template
from specserve.engine.tracing import NullTracer, Tracer
from specserve.kernels import quant_ext
from specserve.kernels.attention_form import choose_form, has_bf16_products
from specserve.kernels.cpu_paged import CpuPagedAttention
from specserve.kernels.metadata import AttentionMetadata, token_positions
from specserve.kernels.registry import get_attention_backend
from specserve.kernels.tuner import KernelTuner, TuneTable, default_row_counts
from specserve.spec.speculator import Speculator
from specserve.target.loader import build_model, check_draft_compatible
from specserve.target.model_runner import ModelRunner
from specserve.target.quantize import quantize_model, resolve_quantization

log = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 << 30
_MAX_DEFAULT_CONTEXT = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from specserve.engine.models import load_tokenizer, resolve_draft, resolve_model_path

        # Written back so every reader of the config sees the draft actually loaded.
        config.draft_model = resolve_draft(config.model, config.draft_model)
        if config.speculative_method == "draft" and config.draft_model is None:
            raise ConfigError("speculative-method draft needs --draft-model PATH")
        self.config = config
        self.tracer: Tracer | NullTracer = NullTracer()  # a Tracer records phase spans
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.resolve_device()
        model_path = resolve_model_path(config.model)
        self.model_path = model_path
        self.quantization = resolve_quantization(config.quantization, model_path, self.device)
        self.dtype = config.resolve_dtype(self.device, quantized=self.quantization != "none")
        self.model_config, model = build_model(model_path, self.dtype, self.device)
        quantize_model(model, self.quantization, model_path)
        self.tokenizer = load_tokenizer(config.tokenizer or model_path)
        self.draft_config, draft_model = None, None
        self.eagle_head = None
        if is_eagle_dir(config.draft_model):
            self.eagle_head = self._load_eagle_head(model)
        elif config.speculative_method == "eagle":
            raise ConfigError("speculative-method eagle needs --draft-model DIR, a head folder "
                              "written by `specserve distill --method eagle`")
        elif config.draft_model is not None:
            draft_path = resolve_model_path(config.draft_model)
            self.draft_config, draft_model = build_model(
                draft_path, self.dtype, self.device, shared_embeddings=model.embed_tokens.weight
            )
            # A quantized target's draft runs Q8_0 blocks and the same fused kernels: a float32
            # draft step would cost a third of a quantized target step and eat the gain.
            quantize_model(draft_model, "int8" if self.quantization != "none" else "none",
                           draft_path)
            check_draft_compatible(
                self.model_config, self.draft_config, self.tokenizer, load_tokenizer(draft_path)
            )
        backend = config.attention_backend
        if backend == "auto" and self.quantization != "none" and quant_ext.available():
            backend = "cpu_paged"  # batch-invariant, like the quantized projections
        self.kv_dtype = config.resolve_kv_dtype(
            self.dtype, backend, self.device,
            backend == "cpu_paged" and has_bf16_products(self.model_config.head_dim))
        self._resolve_limits()
        self.attn_backend = get_attention_backend(
            backend, self.device, block_size=config.block_size
        )
        if self.attn_backend.name == "cpu_paged":  # the C++ attention: its faster form, measured
            mc = self.model_config
            self.attn_backend.form = choose_form(
                mc.num_heads, mc.num_kv_heads, mc.head_dim, cache_root() / "tune",
                measure=config.kernel_tuning, cache_dtype=self.kv_dtype,
            )
        self.runner = ModelRunner(
            self.model_config,
            model,
            num_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            dtype=self.dtype,
            device=self.device,
            attn_backend=self.attn_backend,
            kv_dtype=self.kv_dtype,
        )
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.eos_token_ids = self._eos_ids()
        self.generator = torch.Generator().manual_seed(config.seed)
        # Draft models and EAGLE heads keep float32 caches (their numbers only move acceptance):
        # they run the target's form widened to them.
        draft_backend = self.attn_backend
        if isinstance(self.attn_backend, CpuPagedAttention):
            draft_backend = self.attn_backend.for_float32_caches()
        draft_runner = None
        if draft_model is not None and self.draft_config is not None:
            # Same block ids, separate KV tensors: one block table serves both models.
            draft_runner = ModelRunner(
                self.draft_config, draft_model, num_blocks=config.num_kv_blocks,
                block_size=config.block_size, dtype=self.dtype, device=self.device,
                attn_backend=draft_backend,
            )
            # One span per draft forward (each draft step) without touching the proposer.
            draft_model.register_forward_pre_hook(lambda *_: self.tracer.begin("draft_forward"))
            draft_model.register_forward_hook(lambda *_: self.tracer.end())
        eagle_runner = None
        if self.eagle_head is not None:
            eagle_runner = EagleRunner(
                self.eagle_head, num_blocks=config.num_kv_blocks, block_size=config.block_size,
                dtype=self.dtype, device=self.device, backend=draft_backend,
            )
        self.kernel_table = self._tune_kernels(model, draft_model)
        self.speculator = Speculator(
            config, draft_runner, self.generator,
            None if self.kernel_table is None else self.kernel_table.projection_seconds,
            eagle_runner=eagle_runner,
        )
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        log.info(
            "engine ready: model=%s quantization=%s dtype=%s device=%s kv_blocks=%d "
            "block_size=%d max_model_len=%d backend=%s kv_cache_dtype=%s attention_form=%s",
            model_path, self.quantization, self.dtype, self.device, config.num_kv_blocks,
            config.block_size, config.max_model_len, self.attn_backend.name, self.kv_dtype,
            getattr(self.attn_backend, "form", "-"),
        )

    # ---- set-up -------------------------------------------------------------------------

    def _load_eagle_head(self, model: torch.nn.Module) -> EagleHead:
        """An EAGLE head folder given as --draft-model: the method defaults to eagle (written
        back into the config) and only eagle (or auto) can use it."""
        cfg = self.config
        if cfg.speculative_method is None:
            cfg.speculative_method = "eagle"
        elif cfg.speculative_method == "draft":
            raise ConfigError(f"{cfg.draft_model} is an EAGLE head, not a draft model: use "
                              f"--speculative-method eagle (or leave it unset)")
        head = load_head(cfg.draft_model, self.model_config, model.embed_tokens.weight,
                         self.dtype, self.device)
        if self.quantization != "none":
            # As the draft model: Q8_0 blocks and the fused kernels, so a drafting step costs
            # a small fraction of a quantized target step, not a third of it.
            head.quantize("q8_0")
        return head

    def _tune_kernels(self, model: torch.nn.Module, draft: torch.nn.Module | None
                      ) -> TuneTable | None:
        """Measures (or reads the cached) kernel plan for the target's projections at the row
        counts this engine runs, and the draft's at its own (1 row per sequence)."""
        cfg = self.config
        if not cfg.kernel_tuning or self.device.type != "cpu":
            return None
        tuner = KernelTuner(cache_root() / "tune", "target", progress=True)
        rows = default_row_counts(
            cfg.num_speculative_tokens, cfg.max_num_seqs, cfg.max_num_batched_tokens
        )
        table = tuner.tune(model, rows)
        draft_rows = default_row_counts(0, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        if draft is not None:
            KernelTuner(cache_root() / "tune", "draft", progress=True).tune(draft, draft_rows)
        if self.eagle_head is not None:
            KernelTuner(cache_root() / "tune", "eagle", progress=True).tune(self.eagle_head,
                                                                          draft_rows)
        return table

    def _resolve_limits(self) -> None:
        """Writes the derived context length and KV pool size back into the config."""
        cfg, mc = self.config, self.model_config
        model_max = mc.max_position_embeddings
        if cfg.max_model_len is None:
            cfg.max_model_len = min(model_max, _MAX_DEFAULT_CONTEXT)
        elif cfg.max_model_len > model_max:
            raise ConfigError(
                f"max-model-len {cfg.max_model_len} exceeds the model's "
                f"max_position_embeddings {model_max}; lower --max-model-len"
            )
        per_block = ModelRunner.bytes_per_block(mc, cfg.block_size, self.kv_dtype)
        if self.draft_config is not None:
            per_block += ModelRunner.bytes_per_block(self.draft_config, cfg.block_size, self.dtype)
        if self.eagle_head is not None:
            per_block += EagleRunner.bytes_per_block(self.eagle_head.config, cfg.block_size,
                                                     self.dtype)
        if cfg.num_kv_blocks is None:
            budget = cfg.kv_cache_memory or _DEFAULT_CPU_KV_BYTES
            if self.device.type == "cuda" and cfg.kv_cache_memory is None:
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.9)
            cfg.num_kv_blocks = budget // per_block
        capacity = cfg.num_kv_blocks * cfg.block_size
        if capacity < cfg.max_model_len:
            raise ConfigError(
                f"the KV pool holds {capacity} tokens ({cfg.num_kv_blocks} blocks of "
                f"{cfg.block_size}), fewer than max-model-len {cfg.max_model_len}: raise "
                f"--kv-cache-memory (each block takes {per_block} bytes) or lower --max-model-len"
            )

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(tok_eos)
        return frozenset(ids)

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

    def render_chat(self, messages: list[dict]) -> str:
        with self.tracer.span("chat_template"):
            return apply_chat_template(self.tokenizer, messages)

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
                param="prompt",
            )
        params.validate()
        seq = Sequence(next(self._seq_ids), request_id, ids, params)
        seq.spec_method, seq.spec_k_max = self._resolve_speculation(speculative)
        seq.draft_kv_from_target = (self.eagle_head is not None
                                    and seq.spec_method in ("eagle", "auto"))
        seq.spec_tenant = speculative.tenant if speculative else ""
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        self.requests[request_id] = RequestState(
            seq, detok, self.eos_token_ids, self.config.max_model_len, generator
        )
        self.requests[request_id].timings.speculative_method = seq.spec_method
        self.scheduler.add(seq)

    def _resolve_speculation(self, spec: SpeculativeParams | None) -> tuple[str, int]:
        method = (spec.method if spec else None) or self.config.default_speculative_method
        k = spec.num_tokens if spec and spec.num_tokens is not None else None
        if k is None:  # suffix drafts are as long as their match: they get their own k_max
            cfg = self.config
            k = (cfg.suffix_speculative_tokens if method in ("suffix", "auto")
                 else cfg.num_speculative_tokens)
        if not self.speculator.available(method):
            raise InvalidRequestError(
                f"speculative.method {method!r} needs a server started with --draft-model",
                param="speculative.method",
            )
        return (method, k) if method != "off" and k > 0 else ("off", 0)

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
        """Empties the suffix decoding cache (one tenant's part, or all)."""
        self.speculator.clear_caches(tenant)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> (draft prefill, propose) -> one target forward -> verify -> post-process."""
        spec, tr = self.speculator, self.tracer
        t_start = time.perf_counter()  # the policy's own cost counts in the measured step
        with tr.span("schedule"):
            spec.choose_k(self.scheduler.running, self.config.max_model_len)
            batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        only_decode = all(s.seq.num_tokens - s.seq.num_computed_tokens == 1
                          for s in batch.scheduled)
        rows = {s.seq.seq_id: self._sample_request(s.seq) for s in batch.scheduled if s.samples}
        with tr.span("draft_prefill"):
            spec.draft_prefill(batch)
        with tr.span("propose"):
            drafts = spec.propose(batch, rows)
        t_drafted = time.perf_counter()
        num_drafts = sum(len(d) for d in drafts.tokens.values())
        with tr.span("target_forward", only_decode=only_decode, drafts=num_drafts):
            input_ids, positions, meta, logits_idx, spans = self._prepare(batch, drafts.tokens)
            capture = spec.feature_capture(batch, drafts.tokens, self.device)
            logits, _ = self.runner.forward(input_ids, positions, meta, logits_idx,
                                            capture=capture)
            spec.store_features(capture)
        t_model = time.perf_counter()
        per_seq = {sid: logits[a:b] for sid, (a, b) in spans.items()}
        with tr.span("sample", drafts=num_drafts):  # rejection sampling of the drafts
            results = spec.verify(per_seq, rows, drafts)
        t_sample = time.perf_counter()
        # The policy prices a step by the tokens fed: the forward plus scoring its rows.
        spec.policy.record_target(meta.num_tokens, t_sample - t_drafted)

        outputs: list[RequestOutput] = []
        for s in batch.scheduled:
            seq = s.seq
            state = self.requests[seq.request_id]
            t = state.timings
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = t_start
                t.num_cached_prompt_tokens = seq.num_cached_tokens
            if seq.is_prefill:
                t.prefill_ms += (t_model - t_drafted) * 1e3
            else:
                t.decode_ms += (t_model - t_drafted) * 1e3
            if seq.seq_id not in results:  # a prefill chunk short of the prompt's end
                seq.num_computed_tokens += s.num_new_tokens
                self.block_manager.commit_computed(seq)
                continue
            tokens, accepted, logprobs = results[seq.seq_id]
            seq_drafts = drafts.tokens.get(seq.seq_id, [])
            n_before = seq.num_tokens
            # KV is valid for the fed tokens up to the last accepted draft (see rejection_sampler).
            seq.num_computed_tokens = n_before + accepted
            t.sample_ms += (t_sample - t_model) * 1e3
            if seq_drafts:
                t.draft_ms += drafts.draft_seconds * 1e3
                t.num_drafted += len(seq_drafts)
                t.num_accepted += accepted
                t.num_verify_steps += 1
            if seq.timings.first_token is None:
                seq.timings.first_token = t_sample
            # Stops cut the tokens where plain decoding would; the first `accepted` are drafts.
            state.append(tokens, logprobs, accepted if seq_drafts else 0)
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            spec.after_verify(s, n_before, seq_drafts, accepted)
            if seq.is_finished:
                # Its full blocks enter the prefix cache before they are freed: a request that
                # ends on its first step (max_tokens=1) would otherwise cache none of its prompt.
                self.block_manager.commit_computed(seq)
                self.scheduler.finish(seq)
                spec.forget(seq)
                self.requests.pop(seq.request_id)
            else:
                # Rejected drafts: slots past the new end are overwritten later; whole blocks
                # past it go back to the pool now.
                self.block_manager.truncate(seq, seq.num_tokens)
                self.block_manager.commit_computed(seq)
            outputs.append(state.make_output())
        # Stop checks, detokenization, bookkeeping; then the whole step around every span.
        tr.add("output", t_sample, time.perf_counter())
        tr.add("step", t_start, time.perf_counter(), seqs=len(batch.scheduled))
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
        )

    def _prepare(self, batch: ScheduledBatch, drafts: dict[int, list[int]]):
        """Flattens the scheduled chunks (each decoding sequence: its last token + its drafts)
        into one batch. Returns input_ids [T], positions [T], attention metadata,
        logits_indices [S] and, per sampling sequence, its [start, end) rows in the logits:
        k + 1 rows for a sequence verifying k drafts, 1 for the end of a prefill."""
        ids: list[int] = []
        query_lens, context_lens, tables = [], [], []
        logits_idx: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        for s in batch.scheduled:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            extra = drafts.get(seq.seq_id, [])
            ids.extend(seq.token_ids[start : start + n])
            ids.extend(extra)
            query_lens.append(n + len(extra))
            context_lens.append(start + n + len(extra))
            tables.append(seq.block_table)
            if s.samples:
                first = len(logits_idx)
                logits_idx.extend(range(len(ids) - len(extra) - 1, len(ids)))
                spans[seq.seq_id] = (first, len(logits_idx))
        meta = AttentionMetadata.build(
            query_lens, context_lens, tables, self.config.block_size, self.device
        )
        positions = token_positions(query_lens, context_lens)  # [T]
        return (
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions.to(self.device),
            meta,
            torch.tensor(logits_idx, dtype=torch.int64, device=self.device),
            spans,
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
