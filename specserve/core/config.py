"""EngineConfig: what the user asked of the engine, one field per CLI flag (vLLM's names).

The fields are the one table of engine settings: type, default, bounds and help text live in
each field's annotation, the CLI generates its flags and help from them
(``specserve.core.settings.describe``) and ``validate`` checks every value against them. The
config is frozen: the resolver (``specserve/engine/resolve.py``) turns it, with the machine and
the model files, into the immutable ``ResolvedConfig`` an engine is built from, and never
writes into it, so one config can build any number of engines.

``None`` means "derive it" (see each field's help). Names known only above ``core/`` (the
speculative methods of the proposer registry, the attention backends) are plain strings here and
are checked where their registry is known: the resolver, and the engine for a request's
``speculative.method``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
import torch
from msgspec import Meta

from specserve.core.errors import ConfigError
from specserve.core.settings import check_all

# dtype names the flags take (--dtype, --kv-cache-dtype; the loader and benchmarks read it)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Quantization = Literal["auto", "none", "int4", "int8"]
SuffixScope = Literal["request", "global"]
CrossTokenizerMethod = Literal["auto", "slem", "tli"]


def _help(text: str, **bounds: float | str) -> Meta:
    return Meta(description=text, **bounds)  # type: ignore[arg-type]


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Engine settings, as asked. Read the resolved values from ``ResolvedConfig``."""

    model: Annotated[str | None, _help(
        "local HF folder, .gguf file or hub id (default: built-in SmolLM2-135M-Instruct)")] = None
    tokenizer: Annotated[str | None, _help(
        "tokenizer folder/file (default: the model's own)")] = None
    chat_template: Annotated[str | None, _help(
        "a Jinja chat template file that replaces the tokenizer's (e.g. one that renders "
        "tools for a model whose own template does not)")] = None
    draft_model: Annotated[str | None, _help(
        "draft for speculative decoding, its kind detected from the path: an EAGLE head folder "
        "(published EAGLE-3 layouts, or `specserve distill --method eagle`), a GGUF file or an "
        "HF folder of a small model: with the target's tokenizer it runs as method draft, with "
        "another as text_draft (`default` names the built-in SmolLM2-135M); 'none' for no "
        "draft (default: the shipped distilled draft when the target is the built-in "
        "model)")] = None
    cross_tokenizer_draft: Annotated[bool, _help(
        "a draft model with another tokenizer than the target's runs as text_draft (it drafts "
        "text; the target verifies its own tokens of that text, so the answers stay the "
        "target's); off refuses such a draft")] = True
    cross_tokenizer_method: Annotated[CrossTokenizerMethod, _help(
        "how a text_draft drafts, every way exact: slem (string-level exact match: the draft's "
        "greedy text, re-tokenized into target tokens) | tli (token-level intersection: tokens "
        "drawn from the draft's distribution over the tokens both vocabularies share, verified "
        "against it) | auto (slem for greedy and sampled requests: measured to accept as "
        "much or more)")] = "auto"
    speculative_method: Annotated[str | None, _help(
        "speculative method of requests that name none: a proposer, auto (per step and "
        "sequence, the proposer with the best expected goodput; none when nothing pays) or "
        "off (default: the method the draft implies, eagle for an EAGLE head folder, else "
        "auto)")] = None
    num_speculative_tokens: Annotated[int, _help(
        "k_max: most draft tokens verified per step (0-16)", ge=0, le=16)] = 4
    adaptive_speculation: Annotated[bool, _help(
        "choose k <= k_max per sequence and step from measured costs and acceptance")] = True
    prompt_lookup_min: Annotated[int, _help(
        "n-gram proposer: shortest n-gram to match", ge=1)] = 1
    prompt_lookup_max: Annotated[int, _help(
        "n-gram proposer: longest n-gram to match (tried first)", ge=1)] = 4
    suffix_speculative_tokens: Annotated[int, _help(
        "k_max of suffix decoding (and auto's suffix drafts): a long match may draft this many "
        "tokens (0-16)", ge=0, le=16)] = 16
    prediction_speculative_tokens: Annotated[int, _help(
        "k_max of drafts from a request's predicted output (the `prediction` field): an "
        "aligned prediction may draft this many tokens (0-16)", ge=0, le=16)] = 16
    suffix_cache_tokens: Annotated[int, _help(
        "suffix decoding: global cache bound, in output tokens over all tenants; the oldest "
        "outputs are evicted first", ge=0)] = 1 << 18
    suffix_cache_scope: Annotated[SuffixScope, _help(
        "suffix decoding: request (each request's own text only) | global (also earlier "
        "outputs of the same API key)")] = "global"
    suffix_max_depth: Annotated[int, _help(
        "suffix decoding: longest substring the suffix trie counts", ge=2, le=256)] = 32
    suffix_spec_factor: Annotated[float, _help(
        "suffix decoding: a match of m tokens drafts at most this x m tokens (and at most "
        "--suffix-speculative-tokens)", gt=0)] = 4.0
    dtype: Annotated[Dtype, _help(
        "model dtype (auto: float32 on CPU, where a 16-bit model is not batch-invariant and "
        "speculation could change greedy answers, and around quantized projections; bfloat16 "
        "on GPU)")] = "auto"
    quantization: Annotated[Quantization, _help(
        "weight-only block quantization of the target's projections (auto: a GGUF's own "
        "Q4_0..Q8_0 and Q4_K/Q5_K/Q6_K blocks on CPU, else none)")] = "auto"
    kernel_tuning: Annotated[bool, _help(
        "time the kernel candidates of each projection shape, and the thread setups unless "
        "--num-threads or SPECSERVE_THREAD_POLICY fix them, at start-up (cached per machine "
        "in ~/.cache/specserve/tune); off: defaults")] = True
    device: Annotated[str, _help(
        "auto | cpu | cuda[:N] (auto: cuda when torch sees a GPU)", pattern=r"auto|cpu|cuda(:\d+)?",
    ), Meta(extra={"expect": "auto, cpu or cuda[:N]"})] = "auto"
    max_model_len: Annotated[Annotated[int, Meta(ge=2)] | None, _help(
        "context window in tokens (default: the model's, at most 8192)")] = None
    block_size: Annotated[int, _help("tokens per KV block", ge=1)] = 16
    max_num_seqs: Annotated[int, _help("most sequences in one step", ge=1)] = 64
    max_num_batched_tokens: Annotated[int, _help(
        "token budget of one step (prompts longer than this are prefilled in chunks)",
        ge=1)] = 512
    kv_cache_memory: Annotated[Annotated[int, Meta(ge=1)] | None, _help(
        "bytes for the KV cache pool (default: 2 GiB on CPU, 90% of free GPU memory)")] = None
    kv_cache_dtype: Annotated[Dtype, _help(
        "the target's KV cache elements (auto: bfloat16 for the C++ CPU attention on a CPU "
        "with bfloat16 dot products, else the model dtype; float16 and bfloat16 halve the "
        "bytes attention reads, C++ CPU attention only)")] = "auto"
    num_kv_blocks: Annotated[Annotated[int, Meta(ge=1)] | None, _help(
        "exact number of KV blocks (default: as many as --kv-cache-memory holds)")] = None
    enable_prefix_caching: Annotated[bool, _help("reuse KV of shared prompt prefixes")] = True
    attention_backend: Annotated[str, _help(
        "paged attention backend (auto: the C++ CPU attention for a quantized model on CPU, "
        "else torch; on CUDA the first of flash_attn, triton, sdpa, torch that loads)")] = "auto"
    seed: Annotated[int, _help("seed of the engine's sampler for requests that give none")] = 0
    num_threads: Annotated[int | None, _help(
        "CPU threads: the kernels' team; whether torch's own ops run on it or on one thread is "
        "still measured at start-up (default: the team chosen by measurement too, cached per "
        "machine and model)")] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_all(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"need 1 <= prompt-lookup-min <= prompt-lookup-max (got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max})"
            )
        if self.model is not None and self.model.endswith(".gguf") and not Path(
            self.model
        ).exists():
            raise ConfigError(f"model file not found: {self.model}")
