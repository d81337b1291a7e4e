"""Predicted Outputs (OpenAI's ``prediction`` field): draft from the text the client expects back.

A client editing a file sends the file as its prediction; most of the answer is that file again.
The proposer keeps each sequence aligned with its prediction ``P`` (token ids, [m]) and drafts
``P[cursor : cursor + k]``, where ``cursor`` is the index of the prediction token expected next.
Like every draft it is only a guess: the target's verify decides, so the output is exactly what
decoding without it gives (greedy: the same tokens; sampled: the same distribution).

Per call, with the sequence's output tokens that arrived since the last call (``new``):

1. Aligned: ``new == P[cursor : cursor + len(new)]`` -> the cursor moves past them.
2. Edit guess: only the last new token differs, right after a confirmed alignment -> assume it
   replaced ``P[cursor']`` (a one-token substitution, ``x = 1`` -> ``x = 2``) and expect
   ``P[cursor' + 1]`` next. A guess that the next tokens do not confirm is dropped.
3. Re-find: the longest suffix of the sequence (n = max_n down to 1 tokens) that occurs in ``P``
   with at least one token after it; among its occurrences the first that starts the draft at or
   after the last confirmed alignment (an edit moves forward through the file: after an inserted
   or deleted line, a repeated line such as ``return None`` further on is the one to resume
   at), else the latest occurrence. The draft starts after it.
4. Still nothing (the last token is new to the prediction): the same search over the tokens
   before it, resuming one token further on (it replaced a token).

Worked example, ``P = [10, 11, 12, 13, 14, 15]``, k = 3:
    output []            cursor 0 -> draft [10, 11, 12]
    output [10, 11, 12]  aligned, cursor 3 -> draft [13, 14, 15]
    output [.., 13, 99]  99 replaced 14 (guess), cursor 5 -> draft [15]
An inserted line, output [.., 13, 7, 8, 9]: 7 is a guess (cursor 5), 8 drops it; 8 and 9 occur
nowhere in P -> nothing to draft; once the output is back at [.., 9, 14], the suffix [14] is
found at index 4 (>= the last confirmed 4) -> draft [15].

Cost: an index built once per request: for each n in 1..max_n, the 64-bit rolling hash of every
n-gram of ``P`` that has a continuation, sorted (numpy, O(max_n m log m)). Per call, the aligned
case compares the new tokens only (O(new tokens)); a re-find is at most max_n binary searches
(O(max_n log m)) and one comparison of the chosen window (a hash collision never drafts a
window that does not match). No scan of the prediction per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.draft.base import FinishedSequence, Proposal, ProposalRequest, StatelessProposer

_MASK = (1 << 64) - 1
_BASE = 0x100000001B3  # FNV-64 prime: an odd multiplier of the rolling hash
_MIX = 0x9E3779B97F4A7C15  # token id -> 64-bit value (golden-ratio multiplier)


def _mix(token: int) -> int:
    return ((token + 1) * _MIX) & _MASK


class PredictionIndex:
    """Every n-gram (n = 1..max_n) of a prediction that some token follows, by hash.

    ``ends[n - 1]`` holds the end positions e (the n-gram is ``P[e - n + 1 : e + 1]``) sorted by
    (hash, e); ``hashes[n - 1]`` the matching hashes. ``e <= m - 2``: a window at the very end
    has nothing to draft after it.
    """

    def __init__(self, tokens: Sequence[int], max_n: int) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)  # [m]
        self.max_n = max_n
        self.hashes: list[np.ndarray] = []
        self.ends: list[np.ndarray] = []
        m = self.tokens.shape[0]
        with np.errstate(over="ignore"):  # uint64 arithmetic wraps: hashes are mod 2^64
            mixed = (self.tokens.astype(np.uint64) + np.uint64(1)) * np.uint64(_MIX)  # [m]
            # rolling[e]: hash of the n-gram ending at e, sum_j mix(P[e - j]) * BASE^j
            # (valid for e >= n - 1)
            rolling = mixed.copy()
            for n in range(1, max_n + 1):
                if n > 1:
                    rolling[n - 1 :] = rolling[n - 2 : -1] * np.uint64(_BASE) + mixed[n - 1 :]
                ends = np.arange(n - 1, m - 1, dtype=np.int64)  # [m - n] (empty when m <= n)
                h = rolling[n - 1 : m - 1]
                order = np.lexsort((ends, h))  # by hash, then position
                self.hashes.append(h[order])
                self.ends.append(ends[order])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def find(self, suffix: Sequence[int], at_least: int) -> tuple[int, int] | None:
        """(end e of the chosen occurrence of the longest matching suffix, its length n), or
        None. Prefers the first occurrence whose draft start ``e + 1`` is ``>= at_least``,
        else the latest one."""
        top = min(self.max_n, len(suffix))
        hashes_by_n = []  # [n - 1]: hash of the last n tokens (the index's recurrence, unrolled)
        h, power = 0, 1
        for tok in reversed(suffix[len(suffix) - top :]):
            h = (h + _mix(tok) * power) & _MASK
            power = (power * _BASE) & _MASK
            hashes_by_n.append(h)
        for n in range(top, 0, -1):
            keys, ends = self.hashes[n - 1], self.ends[n - 1]
            key = np.uint64(hashes_by_n[n - 1])
            lo = int(np.searchsorted(keys, key, "left"))
            hi = int(np.searchsorted(keys, key, "right"))
            if lo == hi:
                continue
            run = ends[lo:hi]  # ascending positions
            i = int(np.searchsorted(run, at_least - 1, "left"))
            e = int(run[i] if i < run.shape[0] else run[-1])
            window = self.tokens[e - n + 1 : e + 1]
            if np.array_equal(window, np.asarray(suffix[len(suffix) - n :], dtype=np.int64)):
                return e, n
        return None


@dataclass
class _Alignment:
    """One sequence's place in its prediction."""

    index: PredictionIndex
    seen: int  # sequence tokens already read (starts at the prompt's end)
    cursor: int = 0  # prediction index expected next; -1: lost (re-find every call)
    anchor: int = 0  # the last confirmed cursor: re-finds prefer to resume at or after it
    confirmed: bool = True  # False: the cursor is a guess (an edit, a re-find) not yet seen
    run: int = 0  # tokens matched since the alignment began (the draft's match length)


class PredictionProposer(StatelessProposer):
    """Drafts from each request's ``ProposalRequest.prediction`` (no model, no draft probs).
    State per sequence (its index and cursor) is built on its first proposal and dropped when
    it finishes."""

    name = "prediction"

    def __init__(self, max_n: int = 8) -> None:
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1 (got {max_n})")
        self.max_n = max_n
        self.alignments: dict[int, _Alignment] = {}

    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        drafts: list[list[int]] = []
        matches: list[int] = []
        for req in requests:
            if req.num_tokens < 1:
                raise ValueError(
                    f"num_tokens must be >= 1 (got {req.num_tokens} for seq {req.seq_id})")
            draft, match = self._propose_one(req)
            drafts.append(draft)
            matches.append(match)
        return Proposal(draft_token_ids=drafts, match_lengths=matches)

    def finish(self, done: FinishedSequence) -> None:
        self.alignments.pop(done.seq_id, None)

    def clear(self, tenant: str | None = None) -> None:
        return None  # nothing outlives its request

    def _propose_one(self, req: ProposalRequest) -> tuple[list[int], int]:
        if not req.prediction:
            return [], 0
        al = self.alignments.get(req.seq_id)
        if al is None:
            al = _Alignment(PredictionIndex(req.prediction, self.max_n), req.num_prompt_tokens)
            self.alignments[req.seq_id] = al
        tokens = req.token_ids
        if len(tokens) < al.seen:  # the sequence was cut back: read it again from there
            al.seen, al.cursor, al.confirmed = len(tokens), -1, False
        new = tokens[al.seen :]
        al.seen = len(tokens)
        self._advance(al, new, tokens)
        if al.cursor < 0:
            return [], 0
        pred = al.index.tokens
        return pred[al.cursor : al.cursor + req.num_tokens].tolist(), al.run

    def _advance(self, al: _Alignment, new: Sequence[int], tokens: Sequence[int]) -> None:
        pred = al.index.tokens
        if not new:  # nothing arrived: the place found last time stands
            return
        if al.cursor >= 0:
            ahead = pred[al.cursor : al.cursor + len(new)].tolist()
            same = 0
            while same < len(ahead) and ahead[same] == new[same]:
                same += 1
            if same == len(new):  # 1. aligned
                al.cursor += same
                al.anchor, al.confirmed, al.run = al.cursor, True, al.run + same
                return
            if same > 0 or al.confirmed:
                al.anchor = al.cursor + same
            if (al.confirmed or same > 0) and same == len(new) - 1 \
                    and al.cursor + same + 1 < len(pred):
                al.cursor += same + 1  # 2. the last token replaced one prediction token
                al.confirmed, al.run = False, 0
                return
        # 3. / 4. re-find the place from the sequence's last tokens
        tail = tokens[max(0, len(tokens) - self.max_n) :]
        hit = al.index.find(tail, al.anchor)
        if hit is not None:
            al.cursor, al.run = hit[0] + 1, hit[1]
        else:
            hit = al.index.find(tail[:-1], al.anchor) if len(tail) > 1 else None
            al.cursor = -1 if hit is None or hit[0] + 2 >= len(pred) else hit[0] + 2
            al.run = 0
        al.confirmed = False

    def __repr__(self) -> str:
        return f"PredictionProposer(max_n={self.max_n})"
