"""Independent references the tests compare against: transformers' greedy generate, float64
distributions written from their definitions, a chi-square test without scipy, and the random
inputs (prompts, token streams) they are fed."""

from __future__ import annotations

import math
import random

import torch


def prompts(lengths, seed=0, vocab=300) -> list[list[int]]:
    """Random token-id prompts of the given lengths (ids 3.. so no special token occurs)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``, ``n`` tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """Float64 reference written from the definitions: temperature, keep the k most likely,
    then the smallest most-likely set whose probability reaches top_p; renormalize."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(p, descending=True).tolist()
    if top_k:
        order = order[:top_k]
    kept = torch.zeros_like(p)
    kept[order] = p[order]
    kept /= kept.sum()
    support, mass = [], 0.0
    for tok in order:
        support.append(tok)
        mass += float(kept[tok])
        if mass >= top_p:
            break
    final = torch.zeros_like(p)
    final[support] = kept[support]
    return final / final.sum()


def exact_second_token_distribution(hf, prompt, temperature):
    """P(t2) = sum_t1 p(t1 | prompt) p(t2 | prompt, t1), in float64 from transformers."""
    with torch.no_grad():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        vocab = first.shape[0]
        batch = torch.tensor([prompt + [t] for t in range(vocab)])
        second = torch.softmax(hf(batch).logits[:, -1].double() / temperature, -1)  # [V, V]
    return first @ second


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Chi-square statistic (small cells pooled) and a bound df + 6 sqrt(2 df) that a correct
    sampler stays under for any fixed seed we would pick (no scipy needed)."""
    n = float(counts.sum())
    order = torch.argsort(expected, descending=True)
    big = order[expected[order] * n >= 5]
    small = order[expected[order] * n < 5]
    obs = torch.cat([counts[big], counts[small].sum()[None]])
    exp = torch.cat([expected[big], expected[small].sum()[None]]) * n
    keep = exp > 0
    chi2 = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return chi2, df + 6 * math.sqrt(2 * df)


def random_text(rng: random.Random, n: int) -> list[int]:
    """A token stream of one of four kinds: random, a tiny vocabulary, a run of one token, or
    copies of a short piece with small edits (like code rewrites)."""
    kind = rng.choice(["random", "small_vocab", "repeats", "run"])
    if kind == "random":
        return [rng.randrange(50) for _ in range(n)]
    if kind == "small_vocab":
        return [rng.randrange(3) for _ in range(n)]
    if kind == "run":
        return [7] * n
    base = [rng.randrange(20) for _ in range(rng.randint(3, 9))]
    out: list[int] = []
    while len(out) < n:  # copies with small edits, like code rewrites
        piece = list(base)
        if rng.random() < 0.5:
            piece[rng.randrange(len(piece))] = rng.randrange(20)
        out += piece
    return out[:n]
