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

from kernels.metadata import AttentionMetadata
from kernels.registry import get_attention_backend
from specserve.block_manager import BlockManager
from specserve.config import EngineConfig
from specserve.errors import ConfigError, InvalidRequestError
from specserve.output_processor import RequestState
from specserve.outputs import RequestOutput
from specserve.sampling import SampleRequest, sample
from specserve.sampling_params import SamplingParams
from specserve.scheduler import ScheduledBatch, Scheduler
from specserve.sequence import Sequence
from specserve.tokenizer import IncrementalDetokenizer, apply_chat_template
from target.loader import build_model
from target.model_runner import ModelRunner

log = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 << 30
_MAX_DEFAULT_CONTEXT = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from specserve.models import load_tokenizer, resolve_model_path

        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        model_path = resolve_model_path(config.model)
        self.model_path = model_path
        self.model_config, model = build_model(model_path, self.dtype, self.device)
        self.tokenizer = load_tokenizer(config.tokenizer or model_path)
        self._resolve_limits()
        self.attn_backend = get_attention_backend(config.attention_backend, self.device)
        self.runner = ModelRunner(
            self.model_config,
            model,
            num_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            dtype=self.dtype,
            device=self.device,
            attn_backend=self.attn_backend,
        )
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.eos_token_ids = self._eos_ids()
        self.generator = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        log.info(
            "engine ready: model=%s dtype=%s device=%s kv_blocks=%d block_size=%d "
            "max_model_len=%d backend=%s",
            model_path, self.dtype, self.device, config.num_kv_blocks, config.block_size,
            config.max_model_len, self.attn_backend.name,
        )

    # ---- set-up -------------------------------------------------------------------------

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
        per_block = ModelRunner.bytes_per_block(mc, cfg.block_size, self.dtype)
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
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def render_chat(self, messages: list[dict]) -> str:
        return apply_chat_template(self.tokenizer, messages)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
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
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        self.requests[request_id] = RequestState(
            seq, detok, self.eos_token_ids, self.config.max_model_len, generator
        )
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels a request; its KV blocks return to the pool at once. Returns its final output
        (finish_reason "abort"), or None if it is unknown or already finished."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish(state.seq)
        state.abort()
        return state.make_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        t_start = time.perf_counter()
        input_ids, positions, meta, logits_idx, sampled = self._prepare(batch)
        logits, _ = self.runner.forward(input_ids, positions, meta, logits_idx)
        t_model = time.perf_counter()
        rows = [self._sample_request(s.seq) for s in sampled]
        tokens, logprobs = sample(logits, rows, self.generator) if rows else ([], [])
        t_sample = time.perf_counter()

        model_ms = (t_model - t_start) * 1e3
        for s in batch.scheduled:
            state = self.requests[s.seq.request_id]
            if s.seq.timings.first_scheduled is None:
                s.seq.timings.first_scheduled = t_start
            if s.seq.is_prefill:
                state.timings.prefill_ms += model_ms
            else:
                state.timings.decode_ms += model_ms
            s.seq.num_computed_tokens += s.num_new_tokens
        outputs: list[RequestOutput] = []
        for s, token, lp in zip(sampled, tokens, logprobs):
            seq = s.seq
            state = self.requests[seq.request_id]
            state.timings.sample_ms += (t_sample - t_model) * 1e3
            if seq.timings.first_token is None:
                seq.timings.first_token = t_sample
            state.append([token], [lp])
            self.block_manager.commit_computed(seq)
            if seq.is_finished:
                self.scheduler.finish(seq)
                self.requests.pop(seq.request_id)
            outputs.append(state.make_output())
        for s in batch.scheduled:
            if not s.samples:  # a prefill chunk that did not reach the end of the prompt
                self.block_manager.commit_computed(s.seq)
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

    def _prepare(self, batch: ScheduledBatch):
        """Flattens the scheduled chunks into one batch. Returns input_ids [T], positions [T],
        attention metadata, logits_indices [S] (the last token of each chunk that samples) and
        the ScheduledSeqs those rows belong to."""
        ids: list[int] = []
        query_lens, context_lens, tables = [], [], []
        logits_idx: list[int] = []
        sampled = []
        for s in batch.scheduled:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            ids.extend(seq.token_ids[start : start + n])
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(seq.block_table)
            if s.samples:
                logits_idx.append(len(ids) - 1)
                sampled.append(s)
        meta = AttentionMetadata.build(
            query_lens, context_lens, tables, self.config.block_size, self.device
        )
        q = torch.tensor(query_lens)
        ctx = torch.tensor(context_lens)
        first = torch.repeat_interleave(ctx - q, q)  # [T] first new position of each token's seq
        cu = torch.repeat_interleave(torch.cumsum(q, 0) - q, q)
        positions = first + torch.arange(len(ids)) - cu  # [T]
        return (
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions.to(self.device),
            meta,
            torch.tensor(logits_idx, dtype=torch.int64, device=self.device),
            sampled,
        )

    # ---- offline API --------------------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion with continuous batching; outputs in prompt order."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("give one SamplingParams per prompt, or one for all")
        ids = [f"offline-{next(self._seq_ids)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        finals: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[rid] for rid in ids]
