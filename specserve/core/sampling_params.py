"""SamplingParams: what a request asks of the sampler, validated once at the door."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.core.errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # temperatures under this sample as greedy (vLLM uses the same bound)


@dataclass
class SamplingParams:
    """Sampling and stopping controls for one request.

    ``temperature`` below ``GREEDY_BELOW`` (0 included) means greedy (argmax): dividing logits
    by a smaller one overflows float32. ``top_k == 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes a sampled request reproducible regardless of what else is batched
    with it. ``stop`` strings are matched on the detokenized text and are not included in it;
    ``stop_token_ids`` and EOS end generation (EOS text is not included either).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the chosen token's
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})", param="max_tokens"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(
                f"temperature must be in [0, 100] (got {self.temperature!r})", param="temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(
                f"top_p must be in (0, 1] (got {self.top_p!r})", param="top_p"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be an integer >= 0, 0 disables it (got {self.top_k!r})", param="top_k"
            )
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens] (got {self.min_tokens!r}, "
                f"max_tokens {self.max_tokens})",
                param="min_tokens",
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", param="stop")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(
                f"logprobs must be in [0, 20] (got {self.logprobs!r})", param="logprobs"
            )


@dataclass
class SpeculativeParams:
    """Per-request speculation override (the ``speculative`` request field), for A/B runs:
    ``method`` None keeps the server's method, ``num_tokens`` None keeps its k_max; method "off"
    or num_tokens 0 decodes plainly through the same engine. ``tenant`` is set by the server
    (from the API key), never by the client: suffix decoding drafts only from that tenant's
    earlier outputs. The method's name is checked where the proposers are known: the engine
    refuses one it cannot run (``InvalidRequestError`` naming ``speculative.method``).

    ``prediction`` is the request's predicted output (OpenAI's ``prediction`` field): text,
    tokenized by the engine, or token ids. A request that sends one drafts from it first
    (specserve/draft/prediction.py), and its usage reports how much of it the answer used."""

    method: str | None = None
    num_tokens: int | None = None
    tenant: str = ""
    prediction: str | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_tokens is not None and not 0 <= self.num_tokens <= 16:
            raise InvalidRequestError(
                f"speculative.num_tokens must be in [0, 16] (got {self.num_tokens!r})",
                param="speculative.num_tokens",
            )
