"""Logits adjustments that depend on the request and on what it has generated: ``logit_bias``,
``presence_penalty`` / ``frequency_penalty`` (OpenAI's definition) and ``repetition_penalty``
(vLLM's definition). See ``SamplingParams`` for the formulas.

They apply to the raw logits (after the min_tokens mask), before temperature, top-k and top-p,
to greedy and sampled rows alike, in vLLM's order: bias, then repetition, then frequency and
presence. Logprobs stay those of the model's own distribution (as vLLM reports them by default).

Each request that uses them keeps a ``LogitsState``: its bias as (ids, values) tensors, and, for
the penalties, ``TokenCounts`` updated incrementally with the tokens each step appends (host work
per step is linear in the batch and in the tokens appended, never in the context length).

Under speculation, verify position j of a row scores the token after drafts d_0 .. d_{j-1}, so its
counts must include those drafts: ``adjust_logits`` adds them per position with a cumulative sum
over the row's positions. So a greedy speculative row picks exactly the token plain decoding
would, and a sampled row follows the same adjusted distribution. Worked example, one row with
drafts [a, b, a] (k = 3, positions 0..3) on top of base counts c:

    position:        0        1          2              3
    counts:          c        c + [a]    c + [a, b]     c + [a, b, a]   (a counted twice)

Draft proposers (a draft model, EAGLE) ignore these adjustments: drafts are only proposals, and
the rejection test against the adjusted target keeps the output exact whatever q was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # sampling.py imports this module
    from specserve.core.sampling import SampleRequest


@dataclass
class TokenCounts:
    """A request's token statistics over the vocabulary, kept up to date step by step."""

    output: torch.Tensor  # [V] float32: how often each token occurs among the generated tokens
    seen: torch.Tensor  # [V] bool: the token occurs in the prompt or the generated tokens

    @classmethod
    def start(cls, prompt_ids: list[int], vocab_size: int, device: torch.device) -> TokenCounts:
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if prompt_ids:
            seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        return cls(torch.zeros(vocab_size, dtype=torch.float32, device=device), seen)

    def add(self, token_ids: list[int]) -> None:
        """Counts newly generated tokens (each step's accepted ones, once)."""
        if not token_ids:
            return
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.output.device)
        self.output.index_add_(0, ids, torch.ones(len(token_ids), device=self.output.device))
        self.seen[ids] = True


@dataclass
class LogitsState:
    """One request's adjustments: its parameters, its bias as tensors, and its counts (None
    when no penalty is set)."""

    params: SamplingParams
    bias_ids: torch.Tensor  # [Nb] long
    bias_values: torch.Tensor  # [Nb] float32
    counts: TokenCounts | None

    @classmethod
    def of(cls, params: SamplingParams, prompt_ids: list[int], vocab_size: int,
           device: torch.device) -> LogitsState | None:
        """The state for a new request, or None when it asks for no adjustment."""
        if not params.adjusts_logits:
            return None
        ids = list(params.logit_bias)
        counts = (TokenCounts.start(prompt_ids, vocab_size, device)
                  if params.counts_tokens else None)
        return cls(params,
                   torch.tensor(ids, dtype=torch.long, device=device),
                   torch.tensor([params.logit_bias[t] for t in ids], dtype=torch.float32,
                                device=device),
                   counts)

    def add(self, token_ids: list[int]) -> None:
        if self.counts is not None:
            self.counts.add(token_ids)


def adjust_logits(
    logits: torch.Tensor,  # [sum(k_b + 1), V] row b's positions 0..k_b, row by row
    rows: Sequence[SampleRequest],
    drafts: Sequence[list[int]] | None = None,  # row b's k_b drafts; None: k_b = 0 everywhere
) -> torch.Tensor:  # the same tensor when no row adjusts, else an adjusted copy
    """Applies each row's bias and penalties at every one of its positions, position j counting
    the row's drafts before j (see the module docstring)."""
    ks = [len(d) for d in drafts] if drafts is not None else [0] * len(rows)
    active = [b for b, r in enumerate(rows) if r.logits_state is not None]
    if not active:
        return logits
    out = logits.clone()
    device = logits.device
    starts = [0] * len(rows)
    for b in range(1, len(rows)):
        starts[b] = starts[b - 1] + ks[b - 1] + 1

    # Bias: out[p, id] += value for every position p of the row and every biased id.
    pos_parts, id_parts, val_parts = [], [], []
    for b in active:
        st = rows[b].logits_state
        assert st is not None
        if st.bias_ids.numel():
            n = ks[b] + 1
            pos_parts.append(torch.arange(starts[b], starts[b] + n, device=device)
                             .repeat_interleave(st.bias_ids.numel()))
            id_parts.append(st.bias_ids.repeat(n))
            val_parts.append(st.bias_values.repeat(n))
    if pos_parts:
        p, t = torch.cat(pos_parts), torch.cat(id_parts)
        out[p, t] = out[p, t] + torch.cat(val_parts)

    counted = [b for b in active if rows[b].logits_state.counts is not None]  # type: ignore[union-attr]
    if counted:
        _penalize(out, rows, counted, ks, starts, drafts)
    return out


def _penalize(out: torch.Tensor, rows: Sequence[SampleRequest], counted: list[int],
              ks: list[int], starts: list[int], drafts: Sequence[list[int]] | None) -> None:
    """Repetition, then frequency and presence penalties, in place on ``out``'s rows."""
    device = out.device
    states = [rows[b].logits_state for b in counted]
    positions: list[int] = []  # the rows' positions in ``out``
    owner: list[int] = []  # position -> index into ``counted``
    seg_start: list[int] = []  # position -> index (in ``positions``) of its row's position 0
    inc_pos: list[int] = []  # (index in ``positions``, token): draft d_i counts from i + 1 on
    inc_tok: list[int] = []
    for i, b in enumerate(counted):
        first = len(positions)
        n = ks[b] + 1
        positions.extend(range(starts[b], starts[b] + n))
        owner.extend([i] * n)
        seg_start.extend([first] * n)
        if drafts is not None and ks[b]:
            inc_pos.extend(range(first + 1, first + n))
            inc_tok.extend(drafts[b])
    pos = torch.tensor(positions, device=device)
    own = torch.tensor(owner, device=device)
    base_counts = torch.stack([s.counts.output for s in states])  # type: ignore[union-attr]  # [R, V]
    base_seen = torch.stack([s.counts.seen for s in states])  # type: ignore[union-attr]  # [R, V]
    counts = base_counts[own]  # [P, V]
    seen = base_seen[own]  # [P, V]
    if inc_pos:
        inc = torch.zeros_like(counts)
        inc[torch.tensor(inc_pos, device=device), torch.tensor(inc_tok, device=device)] = 1.0
        cum = inc.cumsum(dim=0)  # [P, V]; a row's position 0 gets no draft, so the value there
        drafted = cum - cum[torch.tensor(seg_start, device=device)]  # is all earlier rows'
        counts = counts + drafted
        seen = seen | (drafted > 0)

    def per_row(name: str) -> torch.Tensor:  # [P, 1]
        values = [getattr(s.params, name) for s in states]  # type: ignore[union-attr]
        return torch.tensor(values, dtype=out.dtype, device=device)[own][:, None]

    x = out[pos]  # [P, V]
    rep = per_row("repetition_penalty")
    x = torch.where(seen & (rep != 1.0), torch.where(x > 0, x / rep, x * rep), x)
    x = x - per_row("frequency_penalty") * counts - per_row("presence_penalty") * (counts > 0)
    out[pos] = x
