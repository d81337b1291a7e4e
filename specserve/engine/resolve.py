"""The resolver: what the user asked (``EngineConfig``), the machine and the model files, turned
into the one immutable ``ResolvedConfig`` an engine is built from.

Every "auto" and every derived value is decided here, once, in one function per rule:

    device                ``resolve_device``       cuda when torch sees a GPU, else cpu
    quantization          target/quantize.py       a GGUF's own blocks on CPU, else none
    dtype                 ``resolve_dtype``        float32 on CPU and around quantized
                                                   projections, bfloat16 on GPU
    attention backend     kernels/registry.py      the C++ attention for a quantized model on
                                                   CPU, else the device's preference order
    KV cache dtype        ``resolve_kv_dtype``     bfloat16 under the C++ attention on CPUs with
                                                   bfloat16 products, else the model's
    limits                ``resolve_limits``       context: the model's, at most 8192; KV blocks
                                                   from the memory budget (2 GiB on CPU, 90% of
                                                   free GPU memory), target + draft per block
    draft                 engine/models.py         the shipped draft beside the built-in model
    speculative method    the proposer registry    what the draft implies (eagle for a head),
                                                   else auto; names checked against the registry;
                                                   off (with the reason, ``speculation_caveat``)
                                                   while a quantized model has projections
                                                   without a batch-invariant kernel
    threads               ``resolve_threads``      fixed by --num-threads or
                                                   SPECSERVE_THREAD_POLICY, else chosen by
                                                   measurement at start-up
                                                   (engine/thread_setup.py)

The config asked for is never written: two engines built from one ``EngineConfig`` see the same
``ResolvedConfig``. The resolved record answers every setting by name: the resolved ones are its
own fields, the rest (block size, budgets, proposer settings, ...) read through to ``asked``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

import torch

from specserve.core.config import DTYPES, EngineConfig
from specserve.core.errors import ConfigError
from specserve.draft.loading import RUNS_AS, DraftSource, how_to_give, open_draft
from specserve.draft.registry import REGISTRY, ProposerRegistry
from specserve.kernels.attention_form import has_bf16_products
from specserve.kernels.registry import resolve_attention_backend
from specserve.kernels.thread_policy import ENV as THREAD_POLICY_ENV
from specserve.kernels.thread_policy import from_env as thread_policy_from_env
from specserve.target.config import ModelConfig
from specserve.target.loader import Weights, read_weights
from specserve.target.model_runner import ModelRunner
from specserve.target.quantize import (
    dense_projection_tensors,
    resolve_quantization,
    speculation_caveat,
)

log = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 << 30
_GPU_KV_FRACTION = 0.9  # of the free memory, when no budget is given
_MAX_DEFAULT_CONTEXT = 8192


@dataclass(frozen=True)
class DraftChoice:
    kind: str  # what it runs as: specserve.draft.loading.RUNS_AS
    path: str


@dataclass(frozen=True)
class ResolvedConfig:
    asked: EngineConfig
    model_path: str
    tokenizer_path: str
    device: torch.device
    dtype: torch.dtype
    quantization: str  # none | int4 | int8 | gguf (a GGUF's own block types)
    attention_backend: str  # a kernels.registry name, never auto
    kv_cache_dtype: torch.dtype
    max_model_len: int
    num_kv_blocks: int
    kv_bytes_per_block: int  # target + draft
    draft: DraftChoice | None
    default_speculative_method: str  # of requests that name none
    # Why speculation may change greedy answers on this model (None: it cannot); then the
    # default method is off unless the user asked for one.
    speculation_caveat: str | None
    threads_fixed_by: str | None  # the flag or variable that fixed them; None: measured

    @property
    def draft_model(self) -> str | None:
        return None if self.draft is None else self.draft.path

    @property
    def quantized(self) -> bool:
        return self.quantization != "none"

    def __getattr__(self, name: str) -> Any:
        # Only for names that are not fields: the settings the resolver passes through.
        if name in _PASS_THROUGH:
            return getattr(self.asked, name)
        raise AttributeError(f"{type(self).__name__} has no {name!r}")

    def summary(self) -> str:
        draft = "none" if self.draft is None else f"{self.draft.kind}:{self.draft.path}"
        return (f"model={self.model_path} quantization={self.quantization} dtype={self.dtype} "
                f"device={self.device} kv_blocks={self.num_kv_blocks} "
                f"block_size={self.asked.block_size} max_model_len={self.max_model_len} "
                f"backend={self.attention_backend} kv_cache_dtype={self.kv_cache_dtype} "
                f"draft={draft} speculative_method={self.default_speculative_method}")


# EngineConfig fields the resolver decides (the record's own fields, or ``asked.<name>``).
_RESOLVED = {"model", "tokenizer", "draft_model", "speculative_method", "dtype", "quantization",
             "device", "max_model_len", "kv_cache_memory", "kv_cache_dtype", "num_kv_blocks",
             "attention_backend"}
_PASS_THROUGH = frozenset(EngineConfig.__struct_fields__) - _RESOLVED
assert not _PASS_THROUGH & {f.name for f in fields(ResolvedConfig)}


@dataclass
class ModelFiles:
    """The model files an engine is built from, opened (read, not built)."""

    model_path: str
    target: Weights
    draft: DraftSource | None

    @classmethod
    def open(cls, asked: EngineConfig) -> ModelFiles:
        from specserve.engine.models import load_tokenizer, resolve_draft, resolve_model_path

        model_path = resolve_model_path(asked.model)
        draft_spec = resolve_draft(asked.model, asked.draft_model)
        target = read_weights(model_path)
        draft = None
        if draft_spec is not None:
            def same_tokens(draft_path: str) -> bool:
                """Both tokenizers map tokens to ids alike (True when either has none)."""
                ours = load_tokenizer(draft_path)
                theirs = load_tokenizer(asked.tokenizer or model_path)
                return ours is None or theirs is None or ours.get_vocab() == theirs.get_vocab()

            draft = open_draft(resolve_model_path(draft_spec), target.config,
                               same_tokens=same_tokens,
                               cross_tokenizer=asked.cross_tokenizer_draft)
        return cls(model_path, target, draft)


def resolve_config(asked: EngineConfig, files: ModelFiles,
                   registry: ProposerRegistry = REGISTRY) -> ResolvedConfig:
    method = resolve_speculative_method(asked.speculative_method, files.draft, registry)
    device = resolve_device(asked.device)
    quantization = resolve_quantization(asked.quantization, files.model_path, device)
    quantized = quantization != "none"
    dtype = resolve_dtype(asked.dtype, device, quantized)
    mc = files.target.config
    caveat = speculation_caveat(dense_projection_tensors(quantization, files.model_path, mc))
    if caveat is not None:
        if asked.speculative_method is None:
            method = "off"
        log.warning("%s%s", caveat, "" if asked.speculative_method is None else
                    f" (--speculative-method {asked.speculative_method} asks for it: every "
                    f"request that does not say otherwise speculates)")
    backend = resolve_attention_backend(asked.attention_backend, device,
                                        block_size=asked.block_size, quantized=quantized)
    kv_dtype = resolve_kv_dtype(asked.kv_cache_dtype, dtype, backend, device,
                                backend == "cpu_paged" and has_bf16_products(mc.head_dim))
    per_block = ModelRunner.bytes_per_block(mc, asked.block_size, kv_dtype)
    if files.draft is not None:
        per_block += files.draft.kv_bytes_per_block(asked.block_size, dtype)
    max_model_len, num_blocks = resolve_limits(asked, mc, per_block, device)
    draft = None if files.draft is None else DraftChoice(files.draft.kind, files.draft.path)
    return ResolvedConfig(
        asked=asked, model_path=files.model_path,
        tokenizer_path=asked.tokenizer or files.model_path,
        device=device, dtype=dtype, quantization=quantization, attention_backend=backend,
        kv_cache_dtype=kv_dtype, max_model_len=max_model_len, num_kv_blocks=num_blocks,
        kv_bytes_per_block=per_block, draft=draft, default_speculative_method=method,
        speculation_caveat=caveat, threads_fixed_by=resolve_threads(asked),
    )


def resolve_threads(asked: EngineConfig) -> str | None:
    """What fixed the threads, as the user wrote it (``--num-threads 2``,
    ``SPECSERVE_THREAD_POLICY=spin_us=50,wait_us=20``), or None: the engine chooses them by
    measurement once it is built. A malformed variable is an error here: the user meant to fix
    the policy, and measuring instead would hide the typo."""
    fixed = []
    if asked.num_threads:
        fixed.append(f"--num-threads {asked.num_threads}")
    try:
        policy = thread_policy_from_env()
    except ValueError as exc:
        raise ConfigError(f"{exc}; or unset {THREAD_POLICY_ENV} to let the engine choose by "
                          f"measurement") from None
    if policy is not None:
        fixed.append(f"{THREAD_POLICY_ENV}={policy.name}")
    return " and ".join(fixed) or None


def resolve_speculative_method(asked: str | None, draft: DraftSource | None,
                               registry: ProposerRegistry) -> str:
    """The method of requests that name none: the one asked (a registry name, auto or off;
    a proposer that runs a draft needs a draft of its kind), else what the draft implies."""
    methods = registry.methods()
    if asked is not None and asked not in methods:
        raise ConfigError(f"speculative-method must be one of {', '.join(methods)} "
                          f"(got {asked!r})")
    kind = None if draft is None else draft.kind
    spec = registry.specs.get(asked) if asked is not None else None
    if spec is not None and spec.needs_draft is not None and spec.needs_draft != kind:
        if draft is None:
            raise ConfigError(f"speculative-method {asked} needs {how_to_give(spec.needs_draft)}")
        usable = " or ".join(registry.for_draft(draft.kind)) or "another method"
        raise ConfigError(f"{draft.path} is {RUNS_AS[draft.kind]}, not "
                          f"{RUNS_AS[spec.needs_draft]}: use --speculative-method {usable} "
                          f"(or leave it unset)")
    return asked if asked is not None else registry.default_method(kind)


def resolve_device(asked: str) -> torch.device:
    if asked == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(asked)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    return device


def resolve_dtype(asked: str, device: torch.device, quantized: bool = False) -> torch.dtype:
    """auto: float32 around quantized projections (their kernels take and give float32);
    else bfloat16 on GPUs, float32 on CPUs. A CPU bf16 model is not batch-invariant (a
    k+1-row verify and one-row steps round differently), so speculation there could change
    greedy answers; float32 is the lossless default."""
    if quantized:
        if asked not in ("auto", "float32"):
            raise ConfigError(
                f"quantized projections compute in float32; use --dtype auto or float32 "
                f"with --quantization (got --dtype {asked}), or --quantization none"
            )
        return torch.float32
    if asked != "auto":
        return DTYPES[asked]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_kv_dtype(asked: str, model_dtype: torch.dtype, backend: str, device: torch.device,
                     bf16_products: bool) -> torch.dtype:
    """The target's KV cache dtype: the model's, or float16 / bfloat16 where the C++
    attention (``cpu_paged``) reads it. ``auto`` takes bfloat16 there when the CPU has
    bfloat16 dot products (``bf16_products``: the attention's cheapest form, half the bytes
    read per key and half the multiply instructions; llama.cpp's default cache is float16
    for the same reason), else the model's dtype."""
    cpp = backend == "cpu_paged" and device.type == "cpu"
    if asked == "auto":
        return torch.bfloat16 if cpp and bf16_products else model_dtype
    if asked in ("float16", "bfloat16") and not cpp:
        raise ConfigError(
            f"kv-cache-dtype {asked} needs the C++ CPU attention (a quantized model on "
            f"CPU, --attention-backend auto or cpu_paged); this engine uses {backend!r} on "
            f"{device.type}: use --kv-cache-dtype auto"
        )
    return DTYPES[asked]


def resolve_limits(asked: EngineConfig, model: ModelConfig, per_block: int,
                   device: torch.device) -> tuple[int, int]:
    """(max_model_len, num_kv_blocks): the context window and the KV pool, which must hold at
    least one whole context. ``per_block``: KV bytes of one block, target and draft."""
    model_max = model.max_position_embeddings
    max_len = asked.max_model_len
    if max_len is None:
        max_len = min(model_max, _MAX_DEFAULT_CONTEXT)
    elif max_len > model_max:
        raise ConfigError(
            f"max-model-len {max_len} exceeds the model's max_position_embeddings {model_max}; "
            f"lower --max-model-len"
        )
    num_blocks = asked.num_kv_blocks
    if num_blocks is None:
        budget = asked.kv_cache_memory or _DEFAULT_CPU_KV_BYTES
        if device.type == "cuda" and asked.kv_cache_memory is None:
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * _GPU_KV_FRACTION)
        num_blocks = budget // per_block
    capacity = num_blocks * asked.block_size
    if capacity < max_len:
        raise ConfigError(
            f"the KV pool holds {capacity} tokens ({num_blocks} blocks of {asked.block_size}), "
            f"fewer than max-model-len {max_len}: raise --kv-cache-memory (each block takes "
            f"{per_block} bytes) or lower --max-model-len"
        )
    return max_len, num_blocks
