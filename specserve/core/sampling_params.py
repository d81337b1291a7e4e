"""SamplingParams: what a request asks of the sampler, validated once at the door."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.core.errors import InvalidRequestError
from specserve.core.structured import StructuredSpec

GREEDY_BELOW = 1e-5  # temperatures under this sample as greedy (vLLM uses the same bound)
MAX_REPETITION_PENALTY = 100.0  # vLLM asks only > 0; a finite bound keeps logits finite


@dataclass
class SamplingParams:
    """Sampling and stopping controls for one request.

    ``temperature`` below ``GREEDY_BELOW`` (0 included) means greedy (argmax): dividing logits
    by a smaller one overflows float32. ``top_k == 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes a sampled request reproducible regardless of what else is batched
    with it. ``stop`` strings are matched on the detokenized text and are not included in it;
    ``stop_token_ids`` and EOS end generation (EOS text is not included either).

    Logits adjustments (``specserve.core.logits_processors``), applied to the raw logits before
    temperature / top-k / top-p, to greedy and sampled rows alike: ``logit_bias`` adds its value
    (in [-100, 100]) to the logit of each token id; ``presence_penalty`` and
    ``frequency_penalty`` (in [-2, 2]) subtract ``presence * (count > 0) + frequency * count``
    for every token by its count among the generated tokens (OpenAI's definition);
    ``repetition_penalty`` (> 0, 1 = off) divides the positive logits and multiplies the
    negative ones of every token seen in the prompt or the output (vLLM's definition).
    ``structured``: the output must match it (a JSON schema, a regex, ...); the grammar then
    decides where the answer ends, so it does not combine with ``min_tokens``.
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
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def counts_tokens(self) -> bool:
        """Whether a penalty needs the request's token counts."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logits adjustment (bias or penalty) applies."""
        return bool(self.logit_bias) or self.counts_tokens

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
        if self.structured is not None and self.min_tokens:
            raise InvalidRequestError(
                "min_tokens cannot be combined with a structured output (response_format, "
                "structured_outputs): the grammar decides where the answer ends",
                param="min_tokens")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", param="stop")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(
                f"logprobs must be in [0, 20] (got {self.logprobs!r})", param="logprobs"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2] (got {value!r})", param=name)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], 1 disables it "
                f"(got {self.repetition_penalty!r})", param="repetition_penalty")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids >= 0 (got {token!r})", param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias values must be in [-100, 100] (got {bias!r} for token {token})",
                    param="logit_bias")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias names token id {bad[0]}, but this model's vocabulary has "
                f"{vocab_size} tokens (ids 0..{vocab_size - 1})", param="logit_bias")


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
