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

from specserve.outputs import RequestOutput, RequestTimings
from specserve.sampling import TokenLogprob
from specserve.sequence import FinishReason, Sequence
from specserve.text_sources import TextSources
from specserve.tokenizer import IncrementalDetokenizer, find_stop, stream_holdback


@dataclass
class RequestState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    eos_token_ids: frozenset[int]
    max_model_len: int
    generator: torch.Generator | None = None  # the request's own RNG when it has a seed
    text: str = ""
    sent_text_len: int = 0
    sent_token_len: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    timings: RequestTimings = field(default_factory=RequestTimings)
    from_draft: list[bool] = field(default_factory=list)  # per output token (see RequestOutput)
    sources: TextSources = field(default_factory=TextSources)  # per character of ``text``

    def append(self, token_ids: list[int], logprobs: list[TokenLogprob | None],
               num_from_draft: int = 0) -> int:
        """Applies tokens in order until one finishes the request; returns how many were taken
        (the rest, speculative tokens past a stop, are discarded by the caller). The first
        ``num_from_draft`` tokens are accepted drafts, the rest the target's own."""
        seq, params = self.seq, self.seq.params
        taken = 0
        for token_id, lp in zip(token_ids, logprobs):
            seq.append_token(token_id)
            self.from_draft.append(taken < num_from_draft)
            taken += 1
            if lp is not None:
                self.logprobs.append(lp)
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
        before = len(self.text)
        self.text += self.detokenizer.add(token_id)
        self.sources.extend(len(self.text), self.from_draft[-1])
        stops = self.seq.params.stop
        if stops and len(self.text) > before and self.seq.num_output_tokens >= 1:
            match = find_stop(self.text, stops, before)
            if match is not None and self.seq.num_output_tokens >= self.seq.params.min_tokens:
                self.text = self.text[: match.text_end]
                self.sources.truncate(len(self.text))
                self._finish(FinishReason.STOP, match.stop)
        self.timings.detokenize_ms += (time.perf_counter() - t0) * 1e3

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        from specserve.sequence import SequenceStatus

        self.seq.status = SequenceStatus.FINISHED
        self.seq.finish_reason = reason
        self.seq.stop_reason = stop_reason
        if reason == FinishReason.LENGTH and self.detokenizer is not None:
            self.text += self.detokenizer.flush()
            self.sources.extend(len(self.text), bool(self.from_draft and self.from_draft[-1]))

    def abort(self) -> None:
        self._finish(FinishReason.ABORT, None)

    def make_output(self) -> RequestOutput:
        """The cumulative output plus what is new since the last call."""
        seq = self.seq
        finished = seq.is_finished
        holdback = 0 if finished else stream_holdback(seq.params.stop)
        visible = max(self.sent_text_len, len(self.text) - holdback)
        delta = self.text[self.sent_text_len : visible]
        self.sent_text_len = visible
        out_ids = seq.output_token_ids
        new_ids = out_ids[self.sent_token_len :]
        new_from_draft = self.from_draft[self.sent_token_len :]
        self.sent_token_len = len(out_ids)
        t = seq.timings
        self.timings.num_preemptions = t.num_preemptions
        if t.first_token is not None:
            self.timings.ttft_ms = (t.first_token - t.arrival) * 1e3
        if t.first_scheduled is not None:
            self.timings.queue_ms = (t.first_scheduled - t.arrival) * 1e3
        if finished:
            t.finished = t.finished or time.perf_counter()
            self.timings.e2e_ms = (t.finished - t.arrival) * 1e3
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=self.text[:visible],
            token_ids=list(out_ids),
            delta_text=delta,
            new_token_ids=new_ids,
            logprobs=list(self.logprobs) if seq.params.logprobs is not None else None,
            finished=finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            timings=self.timings,
            new_from_draft=new_from_draft,
            delta_spans=self.sources.spans(visible - len(delta), visible),
        )
