"""Building an engine's parts from its resolved configuration and its opened model files.

Nothing here decides a setting (the resolver did, specserve/engine/resolve.py) and nothing here
names a proposer or a kind of draft: a draft is built by its own ``DraftSource``
(specserve/draft/loading.py) and handed to the speculator, which builds the proposers that can
run on it from the registry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from specserve.core.paths import cache_root
from specserve.draft.loading import DraftTarget, LoadedDraft
from specserve.draft.registry import REGISTRY, ProposerRegistry
from specserve.engine.block_manager import BlockManager
from specserve.engine.models import load_tokenizer
from specserve.engine.resolve import ModelFiles, ResolvedConfig
from specserve.engine.scheduler import Scheduler
from specserve.engine.thread_setup import choose_threads
from specserve.kernels.attention_form import choose_form
from specserve.kernels.registry import AttentionBackend, get_attention_backend
from specserve.kernels.thread_choice import ThreadChoice
from specserve.kernels.tuner import KernelTuner, TuneTable, default_row_counts
from specserve.spec.speculator import Speculator
from specserve.target.config import ModelConfig
from specserve.target.loader import build_model
from specserve.target.model import CausalLM
from specserve.target.model_runner import ModelRunner
from specserve.target.quantize import quantize_model

# Seconds from an engine's start to the end of its kernel tuning (kernels/tuner.py, "Deadline"):
# the imports before it, the thread choice (<= 4 s) and the server's warm-up after it fit in what
# is left of the minute a first start may take.
TUNING_DEADLINE_S = 45.0


@dataclass
class EngineParts:
    model_config: ModelConfig
    tokenizer: Any
    runner: ModelRunner
    block_manager: BlockManager
    scheduler: Scheduler
    speculator: Speculator
    draft: LoadedDraft | None
    eos_token_ids: frozenset[int]
    kernel_table: TuneTable | None
    threads: ThreadChoice


def build_parts(config: ResolvedConfig, files: ModelFiles, registry: ProposerRegistry = REGISTRY,
                started: float | None = None) -> EngineParts:
    """``started``: ``time.perf_counter()`` when the engine began (None: now)."""
    deadline = (time.perf_counter() if started is None else started) + TUNING_DEADLINE_S
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_config, model = build_model(files.target, config.dtype, config.device,
                                      native_blocks=config.quantization == "gguf")
    quantize_model(model, config.quantization, config.model_path)
    tokenizer = load_tokenizer(config.tokenizer_path, config.asked.chat_template)
    attn = _attention(config, model_config)
    runner = ModelRunner(model_config, model, num_blocks=config.num_kv_blocks,
                         block_size=config.block_size, dtype=config.dtype, device=config.device,
                         attn_backend=attn, kv_dtype=config.kv_cache_dtype)
    block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                 config.enable_prefix_caching)
    draft = None
    if files.draft is not None:
        draft = files.draft.build(DraftTarget(
            model, model_config, tokenizer, load_tokenizer, config.dtype, config.device,
            config.quantized, config.num_kv_blocks, config.block_size, attn,
        ))
    table = _tune_kernels(config, model, draft, deadline)
    threads = choose_threads(config, runner)  # after tuning: it times the tuned kernels
    speculator = Speculator(
        config.asked, config.default_speculative_method, config.max_model_len, block_manager,
        torch.Generator().manual_seed(config.seed), draft,
        None if table is None else table.projection_seconds, registry,
    )
    return EngineParts(model_config, tokenizer, runner, block_manager,
                       Scheduler(config, block_manager), speculator, draft,
                       _eos_ids(model_config, tokenizer), table, threads)


def _attention(config: ResolvedConfig, model_config: ModelConfig) -> AttentionBackend:
    attn = get_attention_backend(config.attention_backend, config.device,
                                 block_size=config.block_size)
    if attn.name == "cpu_paged":  # the C++ attention: its faster form, measured
        mc = model_config
        attn.form = choose_form(  # type: ignore[attr-defined]
            mc.num_heads, mc.num_kv_heads, mc.head_dim, cache_root() / "tune",
            measure=config.kernel_tuning, cache_dtype=config.kv_cache_dtype,
        )
    return attn


def _tune_kernels(config: ResolvedConfig, model: CausalLM, draft: LoadedDraft | None,
                  deadline: float) -> TuneTable | None:
    """Measures (or reads the cached) kernel plan for the target's projections at the row
    counts this engine runs, and the draft's at its own (1 row per sequence), both by the
    start's ``deadline`` (a perf_counter reading)."""
    if not config.kernel_tuning or config.device.type != "cpu":
        return None
    tune_dir = cache_root() / "tune"
    rows = default_row_counts(
        config.num_speculative_tokens, config.max_num_seqs, config.max_num_batched_tokens
    )
    table = KernelTuner(tune_dir, "target", progress=True, deadline=deadline).tune(model, rows)
    if draft is not None:
        draft_rows = default_row_counts(0, config.max_num_seqs, config.max_num_batched_tokens)
        KernelTuner(tune_dir, draft.tune_name, progress=True, deadline=deadline).tune(
            draft.module, draft_rows)
    return table


def _eos_ids(model_config: ModelConfig, tokenizer: Any) -> frozenset[int]:
    ids = set(model_config.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(tok_eos)
    return frozenset(ids)
