"""Text side of a request: incremental UTF-8-safe detokenization and stop strings.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a prefix
yields U+FFFD. The detokenizer therefore decodes a short window of recent tokens and only emits
text once it no longer ends in a replacement character (the approach of vLLM and TGI).
"""

from __future__ import annotations

from dataclasses import dataclass

# Prompt tokens kept as left context, so leading spaces of the first output token decode as they
# would inside the full text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Feeds token ids one at a time and returns each one's new text (possibly empty)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (an incomplete character is
        emitted as U+FFFD, exactly what a full decode would produce)."""
        new_text = self._decode(self.ids[self.prefix_offset :])
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


@dataclass
class StopMatch:
    text_end: int  # the text is cut here (the stop string is not included)
    stop: str


def find_stop(text: str, stops: list[str], new_from: int) -> StopMatch | None:
    """Finds the earliest stop string that ends in the text added from index ``new_from`` on (so
    a stop string spanning the previous and the new text is found too)."""
    best: StopMatch | None = None
    for stop in stops:
        start = max(0, new_from - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best.text_end):
            best = StopMatch(text_end=idx, stop=stop)
    return best


def stream_holdback(stops: list[str]) -> int:
    """Characters a stream must hold back so a stop string that might still complete is never
    sent to the client."""
    return max((len(s) for s in stops), default=1) - 1


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None) -> str:
    """Renders chat messages with the model's own template (from its tokenizer); ``tools``
    (OpenAI's function tools) go to the template's ``tools`` argument."""
    if getattr(tokenizer, "chat_template", None) is None:
        from specserve.core.errors import InvalidRequestError

        raise InvalidRequestError(
            "this model's tokenizer has no chat template; use the completions API with a plain "
            "prompt",
            param="messages",
        )
    kw = {} if tools is None else {"tools": tools}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
    )
