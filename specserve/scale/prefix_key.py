"""The routing key of a request: chained hashes of its prompt's first KV blocks, computed in the
Ray ingress with the model's own tokenizer and chat template, so the block boundaries are the
engine prefix cache's (``block_size`` tokens, no special tokens added, as ``LLMEngine.encode``).
Ray-free; ``ray_router.PrefixAffinityRouter`` consumes the key."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import msgspec

from specserve.engine.tokenizer import apply_chat_template
from specserve.server import protocol as P

# A token is at most this many characters in the vocabularies we serve (byte-level BPE merges
# are short); cutting the text there tokenizes only what the key needs.
_MAX_CHARS_PER_TOKEN = 32
R = TypeVar("R", bound=Hashable)  # a replica's id


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


class AffinityTable:
    """Prefix hash -> replicas that were sent that prefix (LRU-bounded), and the choice rule:
    the least-loaded live owner of the deepest known block hash, unless it has more than
    ``imbalance`` requests in flight beyond the least-loaded replica overall; then the
    least-loaded replica, which becomes an owner too (a hot prefix spreads, it does not pile
    up). Ray-free: ``ray_router.PrefixAffinityRouter`` supplies the replicas and their load."""

    def __init__(self, imbalance: int, max_entries: int = 1 << 16) -> None:
        self.imbalance, self.max_entries = imbalance, max_entries
        self.owners: OrderedDict[int, list[Hashable]] = OrderedDict()  # oldest used first

    def choose(self, hashes: tuple[int, ...], live: list[R], load: Callable[[R], int]) -> R:
        """``live``: candidate replica ids (not empty)."""
        least = min(live, key=load)
        preferred = self._preferred(hashes, live, load)
        chosen = (least if preferred is None or load(preferred) - load(least) > self.imbalance
                  else preferred)
        for h in hashes:
            owners = self.owners.pop(h, None) or []
            if chosen not in owners:
                owners.append(chosen)
            self.owners[h] = owners
        while len(self.owners) > self.max_entries:
            self.owners.popitem(last=False)
        return chosen

    def forget(self, replica: Hashable) -> None:
        """A dead replica's cache is gone: it owns nothing any more."""
        for h, owners in list(self.owners.items()):
            if replica in owners:
                owners.remove(replica)
                if not owners:
                    del self.owners[h]

    def _preferred(self, hashes: tuple[int, ...], live: list[R],
                   load: Callable[[R], int]) -> R | None:
        alive = set(live)
        for h in reversed(hashes):  # the deepest block first
            owners = [o for o in self.owners.get(h, ()) if o in alive]
            if owners:
                return min(owners, key=load)  # type: ignore[arg-type]
        return None
