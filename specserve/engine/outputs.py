"""What the engine hands back for a request after each step."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

from specserve.core.sampling import TokenLogprob
from specserve.engine.prediction_usage import PredictionUsage


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
    # Set when the request speculates on a model where that may change greedy answers (the
    # resolver's speculation_caveat: projections without a batch-invariant kernel).
    warning: str | None = None

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
    """What is new for one request since its previous output (a delta), plus its running state.

    ``text``, ``token_ids`` and ``logprobs`` hold only what this output adds, so the engine's
    per-step work and the memory a stream holds do not grow with the length of the answer.
    ``text`` is safe to stream: it never contains characters that might still turn out to be the
    start of a stop string (they are held back until that is decided). ``OutputMerger`` folds
    consecutive deltas into one (a slow reader's backlog, or the whole answer for a
    non-streaming response); ``LLMEngine.generate`` returns merged, complete outputs.
    """

    request_id: str
    prompt_token_ids: list[int]  # the engine's own list, shared, never copied per step
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # None unless the request asked for logprobs
    num_output_tokens: int = 0  # all output tokens so far, not only this delta's
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    timings: RequestTimings = field(default_factory=RequestTimings)
    # Where the new tokens came from, for showing acceptance (the playground): per token of
    # ``token_ids``, True when it was a draft token the target accepted (False: the target's
    # own bonus / recovered token, a prefill's first token, or plain decoding). ``delta_spans``
    # covers ``text`` in order as (length in code points, from_draft) runs. Both are
    # deltas: merging two outputs concatenates them.
    new_from_draft: list[bool] = field(default_factory=list)
    delta_spans: list[tuple[int, bool]] = field(default_factory=list)
    # On the finished output of a request that sent a prediction: how much of it the answer
    # used (specserve/engine/prediction_usage.py); None otherwise.
    prediction_usage: PredictionUsage | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class OutputMerger:
    """Folds consecutive deltas of one request into a single output, in time linear in what they
    carry (text goes to a ``StringIO``, ids and logprobs are extended in place).

    It takes ownership of the outputs it is given: the first one becomes the merged one.
    """

    def __init__(self) -> None:
        self._head: RequestOutput | None = None
        self._text = io.StringIO()
        self.num_chars = 0  # text held, for tests and gauges of what a reader has not taken

    def __bool__(self) -> bool:
        return self._head is not None

    @property
    def num_tokens(self) -> int:
        return 0 if self._head is None else len(self._head.token_ids)

    def add(self, out: RequestOutput) -> None:
        self._text.write(out.text)
        self.num_chars += len(out.text)
        head = self._head
        if head is None:
            self._head = out
            return
        head.token_ids.extend(out.token_ids)
        head.new_from_draft.extend(out.new_from_draft)
        for length, flag in out.delta_spans:  # adjacent runs of one origin join
            if head.delta_spans and head.delta_spans[-1][1] == flag:
                head.delta_spans[-1] = (head.delta_spans[-1][0] + length, flag)
            else:
                head.delta_spans.append((length, flag))
        if out.logprobs is not None:
            if head.logprobs is None:
                head.logprobs = []
            head.logprobs.extend(out.logprobs)
        head.num_output_tokens = out.num_output_tokens
        head.finished, head.finish_reason = out.finished, out.finish_reason
        head.stop_reason, head.timings = out.stop_reason, out.timings
        head.prediction_usage = out.prediction_usage

    def take(self) -> RequestOutput | None:
        """The merged output (None if nothing was added); the merger starts empty again."""
        head = self._head
        if head is not None:
            head.text = self._text.getvalue()
        self._head, self._text, self.num_chars = None, io.StringIO(), 0
        return head
