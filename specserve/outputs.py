"""What the engine hands back for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.sampling import TokenLogprob


@dataclass
class RequestTimings:
    """Milliseconds spent per phase (attributed from the engine steps the request took part in),
    plus time to first token. Filled as the request runs."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    sample_ms: float = 0.0
    draft_ms: float = 0.0
    detokenize_ms: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    num_drafted: int = 0  # draft tokens proposed and verified
    num_accepted: int = 0  # of those, accepted by the target
    num_verify_steps: int = 0  # steps that verified >= 1 draft; drafted / steps = mean chosen k
    speculative_method: str = "off"

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verify step (accepted drafts + the recovered/bonus token)."""
        if not self.num_verify_steps:
            return None
        return (self.num_accepted + self.num_verify_steps) / self.num_verify_steps


@dataclass
class RequestOutput:
    """Cumulative state of one request plus what is new since the previous output.

    ``delta_text`` is safe to stream: it never contains characters that might still turn out to
    be the start of a stop string (they are held back until that is decided).
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    timings: RequestTimings = field(default_factory=RequestTimings)
    # Where the new tokens came from, for showing acceptance (the playground): per token of
    # ``new_token_ids``, True when it was a draft token the target accepted (False: the target's
    # own bonus / recovered token, a prefill's first token, or plain decoding). ``delta_spans``
    # covers ``delta_text`` in order as (length in code points, from_draft) runs. Both are
    # deltas: merging two outputs concatenates them.
    new_from_draft: list[bool] = field(default_factory=list)
    delta_spans: list[tuple[int, bool]] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
