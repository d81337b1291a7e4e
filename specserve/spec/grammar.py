"""Grammar state per sequence, and how it meets speculation: drafts cut at the first token the
grammar rejects, one token mask per verify row, advance over accepted tokens, roll back over
rejected ones.

One step of a constrained sequence with drafts d_0 .. d_{k-1} (``GrammarState.prepare``):

    mask row 0 = allowed after the tokens so far          (the matcher's state s)
    d_0 allowed by row 0? accept it -> state s + d_0;      mask row 1 = allowed after d_0
    ...                                                    mask row j = allowed after d_0..d_{j-1}
    the first d_m the grammar rejects, and every draft after it, is cut before verify

so the verify pass scores only drafts the grammar allows, and row j of the target's logits is
masked exactly as plain constrained decoding would mask it after the same j tokens. The
rejection sampler then accepts a prefix d_0..d_{a-1} and emits one more token t drawn from the
masked row a (``commit``): the matcher rolls back the m - a drafts it did not keep and accepts
t. Greedy constrained output is therefore token-identical with and without speculation, and
sampled output follows the masked distribution, whatever proposed the drafts.

Masks are xgrammar token bitmasks: int32 [rows, ceil(V / 32)], bit i of word w allows token
32 w + i. The grammar's stop tokens are the model's EOS ids: once the grammar is complete only
they are allowed, so the answer ends with finish_reason "stop"; ``terminated`` says the grammar
has consumed its end (the engine then ends the request, even under ``ignore_eos``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class GrammarState:
    matcher: Any  # xgrammar.GrammarMatcher over the tokens emitted so far
    vocab_size: int
    encode: Callable[[str], list[int]] | None = None  # text -> token ids (forced drafts)
    pending: int = 0  # drafts the matcher has accepted this step, not yet verified

    @staticmethod
    def start(compiled: Any, vocab_size: int,
              encode: Callable[[str], list[int]] | None = None) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled), vocab_size, encode)

    def forced_tokens(self, k: int) -> list[int]:
        """Up to ``k`` tokens of the text the grammar forces next (xgrammar's jump-forward
        string: a key, the punctuation between values, the rest of an enum value), tokenized
        on its own. A draft like any other: the target verifies it, and where the model would
        tokenize the text differently the draft is simply rejected."""
        if self.encode is None or k <= 0 or self.matcher.is_terminated():
            return []
        text = self.matcher.find_jump_forward_string()
        return self.encode(text)[:k] if text else []

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def prepare(self, drafts: list[int]) -> tuple[int, torch.Tensor]:
        """(how many leading drafts the grammar allows, masks [kept + 1, W]); the matcher is
        left after the kept drafts until ``commit``."""
        import xgrammar as xgr

        assert self.pending == 0, "prepare twice without commit"
        masks = xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(masks, 0)
        kept = 0
        for d in drafts:
            if not self.matcher.accept_token(d):
                break
            kept += 1
            if self.matcher.is_terminated():
                # d is the grammar's end (an EOS): the answer stops at it, so the row after
                # it is never emitted; it stays all-allowed, and no draft follows it
                break
            self.matcher.fill_next_token_bitmask(masks, kept)
        self.pending = kept
        return kept, masks[: kept + 1]

    def commit(self, token_ids: list[int], num_accepted: int) -> None:
        """The step emitted ``token_ids``: its first ``num_accepted`` drafts, then the target's
        token (allowed by the mask of its row, so the matcher accepts it)."""
        if self.pending > num_accepted:
            self.matcher.rollback(self.pending - num_accepted)
        self.pending = 0
        for t in token_ids[num_accepted:]:
            if self.matcher.is_terminated():
                break
            accepted = self.matcher.accept_token(t)
            assert accepted, f"token {t} was sampled from a row whose mask forbids it"


@dataclass
class GrammarStates:
    """The constrained sequences' states, by seq id (owned by the speculator, added and dropped
    with the request)."""

    states: dict[int, GrammarState] = field(default_factory=dict)

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    def get(self, seq_id: int) -> GrammarState | None:
        return self.states.get(seq_id)

    def __bool__(self) -> bool:
        return bool(self.states)
