"""Per-request post-processing of accepted tokens: stop checks, detokenization, stream-safe text.

One ``RequestState`` per request. ``append`` takes the tokens a step produced for the request (one
for plain decoding, several after a speculative verify) and applies them in order, so EOS, stop
token ids, stop strings and max_tokens cut the output at exactly the place plain token-by-token
decoding would; nothing after the stop reaches the text, the token ids or the logprobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specserve.core.logits_processors import LogitsState
from specserve.core.sampling import TokenLogprob
from specserve.core.sequence import FinishReason, Sequence
from specserve.engine.outputs import RequestOutput, RequestTimings
from specserve.engine.prediction_usage import PredictionUsage
from specserve.engine.text_sources import TextSources
from specserve.engine.tokenizer import IncrementalDetokenizer, find_stop, stream_holdback


@dataclass
class RequestState:
    """Text is kept only as far as stop strings need it: ``unsent``, decoded but not yet emitted
    (at most the stream hold-back plus one step's text). A stop string can never begin in text
    already emitted: the hold-back (longest stop - 1 characters) means any stop string starting
    there lay wholly inside the text at the time and was found then. Each step's output carries
    only the new text, token ids and logprobs; nothing here grows with the answer except the
    sequence's own token ids."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    eos_token_ids: frozenset[int]
    max_model_len: int
    generator: torch.Generator | None = None  # the request's own RNG when it has a seed
    logits_state: LogitsState | None = None  # its bias and penalty counts, when it has any
    unsent: str = ""
    sent_token_len: int = 0
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    timings: RequestTimings = field(default_factory=RequestTimings)
    # Origins for showing acceptance (RequestOutput.new_from_draft / delta_spans), also deltas:
    # per token appended since the last output, and per character of ``unsent``.
    new_from_draft: list[bool] = field(default_factory=list)
    unsent_sources: TextSources = field(default_factory=TextSources)
    prediction: list[int] | None = None  # its predicted output's token ids (usage counts)

    def __post_init__(self) -> None:
        self.holdback = stream_holdback(self.seq.params.stop)

    def append(self, token_ids: list[int], logprobs: list[TokenLogprob | None],
               num_from_draft: int = 0) -> int:
        """Applies tokens in order until one finishes the request; returns how many were taken
        (the rest, speculative tokens past a stop, are discarded by the caller). The first
        ``num_from_draft`` tokens are accepted drafts, the rest the target's own."""
        seq, params = self.seq, self.seq.params
        taken = 0
        for token_id, lp in zip(token_ids, logprobs):
            seq.append_token(token_id)
            self.new_from_draft.append(taken < num_from_draft)
            taken += 1
            if lp is not None:
                self.new_logprobs.append(lp)
            n_out = seq.num_output_tokens
            stop_token = (
                (token_id in self.eos_token_ids and not params.ignore_eos)
                or token_id in params.stop_token_ids
            ) and n_out >= params.min_tokens
            if stop_token:
                # The stop token counts as generated (usage) but adds no text.
                self._finish(FinishReason.STOP, token_id)
                break
            self._detokenize(token_id)
            if seq.is_finished:  # a stop string matched
                break
            if n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                self._finish(FinishReason.LENGTH, None)
                break
        return taken

    def _detokenize(self, token_id: int) -> None:
        if self.detokenizer is None:
            return
        t0 = time.perf_counter()
        new = self.detokenizer.add(token_id)
        stops = self.seq.params.stop
        if new and stops and self.seq.num_output_tokens >= self.seq.params.min_tokens:
            # A stop string spanning the unsent and the new text is found too.
            window = self.unsent + new
            match = find_stop(window, stops, len(self.unsent))
            if match is not None:
                self.unsent = window[: match.text_end]
                self.unsent_sources.extend(len(self.unsent), self.new_from_draft[-1])
                self.unsent_sources.truncate(len(self.unsent))
                self._finish(FinishReason.STOP, match.stop)
                new = ""
        self.unsent += new
        self.unsent_sources.extend(len(self.unsent), self.new_from_draft[-1])
        self.timings.detokenize_ms += (time.perf_counter() - t0) * 1e3

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        from specserve.core.sequence import SequenceStatus

        self.seq.status = SequenceStatus.FINISHED
        self.seq.finish_reason = reason
        self.seq.stop_reason = stop_reason
        if reason == FinishReason.LENGTH and self.detokenizer is not None:
            self.unsent += self.detokenizer.flush()
            self.unsent_sources.extend(
                len(self.unsent), bool(self.new_from_draft and self.new_from_draft[-1])
            )

    def finish_structured(self) -> None:
        """A structured output's grammar is complete: the answer ends here."""
        self._finish(FinishReason.STOP, None)

    def abort(self) -> None:
        self._finish(FinishReason.ABORT, None)

    def make_output(self) -> RequestOutput:
        """What is new since the last call (text past the hold-back, token ids, logprobs)."""
        seq = self.seq
        finished = seq.is_finished
        holdback = 0 if finished else self.holdback
        visible = max(0, len(self.unsent) - holdback)
        delta = self.unsent[:visible]
        spans = self.unsent_sources.spans(0, visible)
        if visible:
            self.unsent = self.unsent[visible:]
            self.unsent_sources.drop_prefix(visible)
        n_out = seq.num_output_tokens
        start = seq.num_prompt_tokens + self.sent_token_len
        new_ids = seq.token_ids[start : seq.num_prompt_tokens + n_out]
        self.sent_token_len = n_out
        new_from_draft, self.new_from_draft = self.new_from_draft, []  # one per id in new_ids
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs, self.new_logprobs = self.new_logprobs, []
        t = seq.timings
        self.timings.num_preemptions = t.num_preemptions
        if t.first_token is not None:
            self.timings.ttft_ms = (t.first_token - t.arrival) * 1e3
        if t.first_scheduled is not None:
            self.timings.queue_ms = (t.first_scheduled - t.arrival) * 1e3
        usage = None
        if finished:
            t.finished = t.finished or time.perf_counter()
            self.timings.e2e_ms = (t.finished - t.arrival) * 1e3
            if self.prediction is not None:
                usage = PredictionUsage.of(self.prediction, seq.token_ids[seq.num_prompt_tokens :])
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=delta,
            token_ids=new_ids,
            logprobs=logprobs,
            num_output_tokens=n_out,
            finished=finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            timings=self.timings,
            new_from_draft=new_from_draft,
            delta_spans=spans,
            prediction_usage=usage,
        )
