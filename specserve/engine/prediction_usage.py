"""How much of a request's predicted output its answer used (OpenAI's
``usage.completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens``).

OpenAI documents them as the prediction's tokens that did / did not appear in the completion.
Made exact here: ``accepted`` is the length of the longest common subsequence of the
prediction's tokens and the completion's tokens (the most prediction tokens that appear in the
completion in their order: the lines a diff keeps), ``rejected`` the rest of the prediction,
so ``accepted + rejected`` is the prediction's length. Both follow from the two token lists
alone: they do not depend on how the drafts were cut or batched (the drafted / accepted counts
of the verify steps are in the response's ``timings``).

Computed once, when the request finishes, with the bit-parallel LCS of Allison and Dix /
Hyyro (one row of the dynamic programme is one integer's bits): O(n m / 64) word operations
for an n-token answer and an m-token prediction, a few milliseconds at 4000 x 4000.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PredictionUsage:
    accepted: int  # prediction tokens that appear in the completion (LCS length)
    rejected: int  # prediction tokens that do not

    @classmethod
    def of(cls, prediction: Sequence[int], completion: Sequence[int]) -> PredictionUsage:
        accepted = lcs_length(prediction, completion)
        return cls(accepted, len(prediction) - accepted)


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b``.

    Bit i of ``v`` stands for position i of ``a``; a 0 bit marks where the LCS of ``a[:i+1]``
    and the part of ``b`` read so far steps up. Each token of ``b`` updates every position at
    once: ``u = v & match(token)``, ``v = (v + u) | (v - u)``; at the end the LCS is the
    number of 0 bits among the m positions.
    """
    m = len(a)
    if m == 0 or not b:
        return 0
    match: dict[int, int] = {}  # token -> bit mask of its positions in a
    for i, tok in enumerate(a):
        match[tok] = match.get(tok, 0) | (1 << i)
    full = (1 << m) - 1
    v = full
    for tok in b:
        u = v & match.get(tok, 0)
        if u:
            v = ((v + u) | (v - u)) & full
    return m - v.bit_count()
