"""The offline A/B's backends: one greedy request at a time through this engine, transformers
``generate()`` (plain, assisted, prompt lookup) or llama.cpp, each timed the same way."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from benchmarks.report import BenchError, check_plain

LLAMACPP = "llama.cpp"


@dataclass
class Generation:
    token_ids: list[int]
    seconds: float
    ttft_ms: float | None = None
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0


class Backend(Protocol):
    name: str
    checked: bool  # greedy ids compared with the other modes

    def generate(self, prompt: list[int], max_new_tokens: int) -> Generation: ...


class EngineBackend:
    """This engine; the per-request ``speculative`` override picks the mode."""

    checked = True

    def __init__(self, engine: Any, method: str, k: int, ignore_eos: bool,
                 fresh_cache: bool = False) -> None:
        self.name, self.engine, self.k, self.ignore_eos = method, engine, k, ignore_eos
        # True: empty suffix cache before each request, so a prompt run twice (or by two stop
        # rules) never drafts from its own earlier answer.
        self.fresh_cache = fresh_cache

    def generate(self, prompt: list[int], max_new_tokens: int) -> Generation:
        from specserve.core.sampling_params import SamplingParams, SpeculativeParams

        if self.fresh_cache:
            self.engine.clear_speculation_caches()
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0,
                                ignore_eos=self.ignore_eos)
        t0 = time.perf_counter()
        out = self.engine.generate([prompt], params, SpeculativeParams(self.name, self.k))[0]
        dt = time.perf_counter() - t0
        t = out.timings
        if self.name == "off":
            check_plain(t.num_drafted, "this engine, speculation off")
        return Generation(list(out.token_ids), dt, t.ttft_ms, t.num_drafted, t.num_accepted,
                          t.num_verify_steps)


class HFBackend:
    """transformers ``generate()`` (greedy, batch 1) with optional assisted-generation kwargs."""

    checked = True

    def __init__(self, name: str, model: Any, eos_ids: list[int], **extra: Any) -> None:
        self.name, self.model, self.eos_ids, self.extra = name, model, set(eos_ids), extra

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int) -> Generation:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=max_new_tokens, do_sample=False, **self.extra)
        dt = time.perf_counter() - t0
        return Generation(cut_at_eos(out[0, len(prompt):].tolist(), self.eos_ids), dt)


class LlamaCppBackend:
    """llama.cpp on the GGUF itself. Not checked: its quantized kernels legitimately pick other
    argmaxes than float32 weights do."""

    name, checked = LLAMACPP, False

    def __init__(self, llm: Any, eos_ids: list[int]) -> None:
        self.llm, self.eos_ids = llm, set(eos_ids)

    def generate(self, prompt: list[int], max_new_tokens: int) -> Generation:
        tokens: list[int] = []
        ttft = None
        t0 = time.perf_counter()
        for tok in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1e3
            tokens.append(tok)
            if len(tokens) >= max_new_tokens or tok in self.eos_ids:
                break
        return Generation(tokens, time.perf_counter() - t0, ttft)


def cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """transformers pads after EOS; our engine stops at it (EOS included): keep up to it."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


class ReducedHead(torch.nn.Module):
    """A distilled draft's output head over ``head_ids`` only, as a full-vocabulary lm_head for
    transformers: every other token gets the lowest logit, so argmax and softmax match our
    reduced head (which gives them probability 0)."""

    def __init__(self, num_rows: int, hidden: int, head_ids: torch.Tensor, vocab: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(num_rows, hidden), requires_grad=False)
        self.register_buffer("head_ids", head_ids, persistent=False)
        self.vocab = vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        rows = torch.nn.functional.linear(hidden, self.weight)  # [..., num_rows]
        out = rows.new_full((*rows.shape[:-1], self.vocab), torch.finfo(rows.dtype).min)
        out[..., self.head_ids] = rows
        return out


def hf_model(path: str, dtype: torch.dtype, eos_ids: list[int] | None,
             shared_embeddings: torch.Tensor | None = None) -> Any:
    """transformers' own model class on the very weights our loader reads (a GGUF's cached
    dequantized folder, or the HF folder). A specserve-distilled draft gets its target's
    embeddings (``shared_embeddings``) and a ``ReducedHead``. ``eos_ids`` None: generate
    exactly max_new_tokens."""
    from transformers import AutoModelForCausalLM

    from specserve.target.loader import HEAD_IDS_KEY, load_weights

    hf_config, state_dict = load_weights(path)
    head_ids = state_dict.pop(HEAD_IDS_KEY, None)
    meta = getattr(hf_config, "specserve_draft", None) or {}
    if meta.get("embeddings") == "target":
        if shared_embeddings is None:
            raise BenchError(f"{path} shares its target's embeddings: load it as a draft")
        state_dict["model.embed_tokens.weight"] = shared_embeddings
    if head_ids is not None:
        hf_config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if head_ids is not None:
        head = ReducedHead(len(head_ids), hf_config.hidden_size, head_ids, hf_config.vocab_size)
        model.lm_head = head.to(dtype)
    missing, _ = model.load_state_dict(state_dict, strict=False)
    tied = getattr(hf_config, "tie_word_embeddings", False)
    if [k for k in missing if not (tied and k == "lm_head.weight")]:
        raise BenchError(f"transformers' model for {path} lacks weights: {missing[:3]}")
    model.tie_weights()
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[0] if eos_ids else 0
    return model.eval()


def llamacpp_backend(model_path: str, n_ctx: int, eos_ids: list[int]) -> LlamaCppBackend | None:
    """None unless llama-cpp-python is installed and the model is a GGUF file."""
    try:
        import llama_cpp
    except ImportError:
        return None
    if not model_path.endswith(".gguf"):
        return None
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, verbose=False,
                          n_threads=torch.get_num_threads())
    return LlamaCppBackend(llm, eos_ids)
