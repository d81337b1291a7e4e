"""The routing key of a request: chained hashes of its prompt's first KV blocks, computed in the
Ray ingress with the model's own tokenizer and chat template, so the block boundaries are the
engine prefix cache's (``block_size`` tokens, no special tokens added, as ``LLMEngine.encode``).
Ray-free; ``ray_router.PrefixAffinityRouter`` consumes the key."""

from __future__ import annotations

from typing import Any

import msgspec

from specserve import protocol as P
from specserve.tokenizer import apply_chat_template

# A token is at most this many characters in the vocabularies we serve (byte-level BPE merges
# are short); cutting the text there tokenizes only what the key needs.
_MAX_CHARS_PER_TOKEN = 32


def prefix_hashes(token_ids: list[int], block_size: int, max_blocks: int) -> tuple[int, ...]:
    """Chained hashes of the first ``max_blocks`` full blocks: h_i = hash((h_{i-1}, block_i)),
    so h_i names the whole prefix up to block i. Hashes of int tuples carry no per-process
    salt, so every process computes the same key."""
    out: list[int] = []
    parent = 0
    for b in range(min(max_blocks, len(token_ids) // block_size)):
        parent = hash((parent, *token_ids[b * block_size:(b + 1) * block_size]))
        out.append(parent)
    return tuple(out)


class PrefixKeyer:
    """Body bytes -> routing key. A body it cannot read gets no key (the replica answers 400)."""

    def __init__(self, tokenizer: Any | None, block_size: int, max_blocks: int) -> None:
        self.tokenizer, self.block_size, self.max_blocks = tokenizer, block_size, max_blocks

    def key(self, kind: str, body: bytes) -> tuple[int, ...]:
        try:
            ids = self._prompt_ids(kind, body)
        except Exception:  # malformed body or template error: the replica reports it
            return ()
        return prefix_hashes(ids, self.block_size, self.max_blocks) if ids else ()

    def _prompt_ids(self, kind: str, body: bytes) -> list[int]:
        if kind == "chat":
            chat = msgspec.json.decode(body, type=P.ChatCompletionRequest)
            if self.tokenizer is None:
                return []
            return self._encode(apply_chat_template(self.tokenizer, P.chat_messages(chat)))
        comp = msgspec.json.decode(body, type=P.CompletionRequest)
        prompt = P.completion_prompts(comp)[0]
        return list(prompt) if not isinstance(prompt, str) else self._encode(prompt)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return []
        need = self.block_size * self.max_blocks
        cut = need * _MAX_CHARS_PER_TOKEN
        ids = self.tokenizer.encode(text[:cut], add_special_tokens=False)
        if len(text) > cut:
            ids = ids[:-1]  # the token at the cut may differ from the full text's
        return ids[:need]
