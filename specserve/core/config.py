"""EngineConfig: the one object every component reads. The CLI fills it flag for flag (vLLM's
names); values only known after loading (KV block count, context length, EOS ids) are written
back into it by the engine, not scattered."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from specserve.core.errors import ConfigError

# dtype names the flags take (--dtype, --kv-cache-dtype; the loader and benchmarks read it)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EngineConfig(msgspec.Struct, kw_only=True):
    """Engine settings. ``None`` means "derive it": see each field's comment."""

    model: str | None = None  # local HF folder, .gguf file, or hub id; None = built-in default
    tokenizer: str | None = None  # defaults to the model's own
    # small LM with the target's tokenizer, for method "draft"; None: the shipped draft when the
    # target is the built-in model; "none": no draft
    draft_model: str | None = None
    # a specserve.draft.registry name (draft | ngram | suffix), auto or off; None = draft if a
    # draft is set
    speculative_method: str | None = None
    num_speculative_tokens: int = 4  # k_max: the most draft tokens verified per step
    adaptive_speculation: bool = True  # choose k <= k_max per sequence and step from costs
    prompt_lookup_min: int = 1  # n-gram proposer: shortest n-gram matched
    prompt_lookup_max: int = 4  # n-gram proposer: longest n-gram matched (tried first)
    suffix_speculative_tokens: int = 16  # k_max of suffix decoding (long matches draft long)
    suffix_cache_tokens: int = 1 << 18  # global suffix cache bound (output tokens, all tenants)
    suffix_cache_scope: str = "global"  # request | global (per tenant = API key)
    suffix_max_depth: int = 32  # longest substring the suffix trie counts
    suffix_spec_factor: float = 4.0  # a suffix match of m tokens drafts at most factor x m
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # auto | none | int4 | int8: weight-only block quantization of the target's projections
    # (target/quantize.py). auto: a GGUF's own Q4/Q8 blocks on CPU, else none
    quantization: str = "auto"
    # time the kernel candidates of each projection shape (cached per machine); off: defaults
    kernel_tuning: bool = True
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # None = the model's max_position_embeddings, capped at 8192
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # bytes for the KV pool; None = 2 GiB on CPU, 90% of free memory on GPU
    kv_cache_memory: int | None = None
    # auto | float32 | float16 | bfloat16: the target's KV cache elements. auto: bfloat16 for the
    # C++ CPU attention on CPUs with bfloat16 dot products (AVX-512 BF16), else the model dtype.
    # float16 / bfloat16 halve the bytes attention reads per key (llama.cpp's default is float16;
    # bfloat16 also runs bfloat16 products where the CPU has them); the C++ CPU attention only
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests force tiny pools)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        from specserve.draft.registry import REGISTRY

        methods = REGISTRY.methods()
        if self.speculative_method is not None and self.speculative_method not in methods:
            raise ConfigError(f"speculative-method must be one of {', '.join(methods)} "
                              f"(got {self.speculative_method!r})")
        if not 0 <= self.suffix_speculative_tokens <= 16:
            raise ConfigError(f"suffix-speculative-tokens must be in [0, 16] "
                              f"(got {self.suffix_speculative_tokens})")
        if self.suffix_cache_scope not in ("request", "global"):
            raise ConfigError(f"suffix-cache-scope must be request or global "
                              f"(got {self.suffix_cache_scope!r})")
        if self.suffix_cache_tokens < 0:
            raise ConfigError(f"suffix-cache-tokens must be >= 0 (got {self.suffix_cache_tokens})")
        if not self.suffix_spec_factor > 0:
            raise ConfigError(f"suffix-spec-factor must be > 0 (got {self.suffix_spec_factor})")
        if not 2 <= self.suffix_max_depth <= 256:
            raise ConfigError(f"suffix-max-depth must be in [2, 256] (got {self.suffix_max_depth})")
        if self.speculative_method == "draft" and self.draft_model == "none":
            raise ConfigError("speculative-method draft needs a draft model (not --draft-model "
                              "none)")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"num-speculative-tokens must be in [0, 16] (got {self.num_speculative_tokens})"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                f"need 1 <= prompt-lookup-min <= prompt-lookup-max (got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max})"
            )
        if self.quantization not in ("auto", "none", "int4", "int8"):
            raise ConfigError(
                f"quantization must be auto, none, int4 or int8 (got {self.quantization!r})"
            )
        if self.kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(f"kv-cache-dtype must be auto, float32, float16 or bfloat16 "
                              f"(got {self.kv_cache_dtype!r})")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(
                f"dtype must be one of auto, {', '.join(DTYPES)} (got {self.dtype!r})"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N] (got {self.device!r})")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1 (got {value})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max-model-len must be >= 2 (got {self.max_model_len})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num-kv-blocks must be >= 1 (got {self.num_kv_blocks})")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"kv-cache-memory must be a positive byte count "
                              f"(got {self.kv_cache_memory})")
        if self.model is not None and self.model.endswith(".gguf") and not Path(
            self.model
        ).exists():
            raise ConfigError(f"model file not found: {self.model}")

    @property
    def default_speculative_method(self) -> str:
        """The method of requests that name none. Unset: ``auto`` (suffix decoding, or the
        draft model when one is loaded and pays more; nothing when neither pays), which measured
        at least as fast as every single method on every workload of benchmarks/RESULTS.md
        ("Session 10"). An EAGLE head folder as the draft sets it to ``eagle`` at load."""
        return self.speculative_method if self.speculative_method is not None else "auto"

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "device cuda was asked for but torch sees no CUDA GPU; use --device cpu"
            )
        return device

    def resolve_kv_dtype(self, model_dtype: torch.dtype, backend: str, device: torch.device,
                         bf16_products: bool) -> torch.dtype:
        """The target's KV cache dtype: the model's, or float16 / bfloat16 where the C++
        attention (``cpu_paged``) reads it. ``auto`` takes bfloat16 there when the CPU has
        bfloat16 dot products (``bf16_products``: the attention's cheapest form, half the bytes
        read per key and half the multiply instructions; llama.cpp's default cache is float16
        for the same reason), else the model's dtype."""
        cpp = backend == "cpu_paged" and device.type == "cpu"
        choice = self.kv_cache_dtype
        if choice == "auto":
            return torch.bfloat16 if cpp and bf16_products else model_dtype
        if choice in ("float16", "bfloat16") and not cpp:
            raise ConfigError(
                f"kv-cache-dtype {choice} needs the C++ CPU attention (a quantized model on "
                f"CPU, --attention-backend auto or cpu_paged); this engine uses {backend!r} on "
                f"{device.type}: use --kv-cache-dtype auto"
            )
        return DTYPES[choice]

    def resolve_dtype(self, device: torch.device, quantized: bool = False) -> torch.dtype:
        """auto: float32 around quantized projections (their kernels take and give float32);
        else bfloat16 on GPUs, float32 on CPUs. A CPU bf16 model is not batch-invariant (a
        k+1-row verify and one-row steps round differently), so speculation there could change
        greedy answers; float32 is the lossless default."""
        if quantized:
            if self.dtype not in ("auto", "float32"):
                raise ConfigError(
                    f"quantized projections compute in float32; use --dtype auto or float32 "
                    f"with --quantization (got --dtype {self.dtype}), or --quantization none"
                )
            return torch.float32
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cuda":
            return torch.bfloat16
        return torch.float32

