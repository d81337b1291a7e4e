"""Turning logits into tokens: logits processing (temperature, top-k, top-p, min_tokens) and
sampling, vectorized over the batch.

Greedy rows take the argmax of the raw logits (so greedy output is exactly the model's argmax).
Sampled rows draw from softmax(processed logits); a row whose request has a seed draws with its
own ``torch.Generator``, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `n` most likely (token id, logprob), most likely first


@dataclass
class SampleRequest:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    num_output_tokens: int
    generator: torch.Generator | None
    banned_until_min_tokens: list[int]  # EOS + stop ids, masked while output < min_tokens


def apply_min_tokens(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    """Masks end-of-sequence tokens for rows that have not produced min_tokens yet."""
    for i, r in enumerate(rows):
        if r.num_output_tokens < r.params.min_tokens and r.banned_until_min_tokens:
            logits[i, r.banned_until_min_tokens] = float("-inf")
    return logits


def process_logits(
    logits: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N], > 0
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N], 1 = off
) -> torch.Tensor:  # [N, V], filtered-out tokens at -inf
    """Temperature, then top-k, then top-p (the order of transformers' and vLLM's samplers)."""
    logits = logits / temperature[:, None]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if not (need_k or need_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    if need_k:
        vocab = logits.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [N]
        kth = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if need_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        # Keep the smallest prefix whose mass reaches top_p. The first token always stays,
        # also when top_p underflows to 0 in this dtype (a top_p of 5e-324 once emptied the
        # row and made the step fail with NaN probabilities).
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [N, V] -> softmax(process_logits(...)) [N, V] with each row's own temperature,
    top-k and top-p (rows must not be greedy)."""
    processed = process_logits(
        logits,
        torch.tensor([p.temperature for p in params], dtype=logits.dtype),
        torch.tensor([p.top_k for p in params], dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=logits.dtype),
    )
    return processed.softmax(dim=-1)


def sample(
    logits: torch.Tensor,  # [N, V] float32 raw model logits
    rows: list[SampleRequest],
    default_generator: torch.Generator | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Returns one token per row, and its logprobs when the row's request asked for them."""
    logits = apply_min_tokens(logits.clone(), rows)
    tokens = logits.argmax(dim=-1)  # [N]; greedy rows keep this
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        idx = torch.tensor(sampled)
        probs = sampling_probs(logits[idx], [rows[i].params for i in sampled])  # [S, V]
        unseeded = [j for j, i in enumerate(sampled) if rows[i].generator is None]
        if unseeded:
            draws = torch.multinomial(probs[unseeded], 1, generator=default_generator)[:, 0]
            tokens[idx[unseeded]] = draws
        for j, i in enumerate(sampled):
            if rows[i].generator is not None:
                tokens[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
    token_list = tokens.tolist()
    return token_list, compute_logprobs(logits, token_list, rows)


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], rows: list[SampleRequest]
) -> list[TokenLogprob | None]:
    """Logprobs of the raw model distribution (as vLLM and OpenAI report them)."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return out
    logp = torch.log_softmax(logits[wanted].float(), dim=-1)  # [W, V]
    max_top = max(rows[i].params.logprobs or 0 for i in wanted)
    top_vals, top_ids = logp.topk(max(max_top, 1), dim=-1)
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        tok = token_ids[i]
        out[i] = TokenLogprob(
            token_id=tok,
            logprob=float(logp[j, tok]),
            top=list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())),
        )
    return out
