"""Which form of the C++ paged attention a process runs: ``1024 * seg + 64 * isa + tile``, isa 0
(AVX2), 1 (AVX-512) or 2 (AVX-512 BF16 products: bfloat16 caches only, queries and weights
rounded to bfloat16), tile the query positions per work item (8 or 16), seg 0 (each row's keys
in one run) or 1-3 (keys in segments of 128, 256 or 512 positions, folded in order, so that a
lone sequence's few KV heads spread over every thread).

The two ISAs, and the segment sizes, sum in different orders: they decide the bits. So they are
never chosen by timing: ``numerics`` fixes them from what the CPU has (the widest instruction
set for the cache, segments of ``SEGMENT``), and a process's answers do not depend on how busy
the machine was when it first started, on ``--num-threads`` or on ``--no-kernel-tuning`` (a
first start chose a form without segments on 2 threads and one with them on 1, and 3 of 20
greedy answers differed between the two). Tiles change no bits, and which is faster depends on
the CPU (larger tiles re-read keys less, smaller ones split a verify over more threads): the
first engine on a machine times the tiles of its numerics on the model's attention shape, at a
decode row and two verifies over synthetic paged caches of a short and a long context (~1 s
once per machine), cached per CPU model, torch threads, shape and extension build under
``$SPECSERVE_CACHE_DIR/tune``.

The timing has a budget (``DEFAULT_BUDGET_S``): a pass times every candidate on every case, and
no pass starts once the budget is spent (the warm-up and one timed pass always run), so a busy
machine chooses from fewer passes instead of stalling its first start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specserve.kernels import quant_ext
from specserve.kernels.tuner import cpu_model

log = logging.getLogger(__name__)

AVX2, AVX512, BF16_DOT = 0, 1, 2  # isa
TILES = (8, 16)
SEGMENTS = (0, 1, 2, 3)  # 0: none; s: segments of 64 << s key positions
DEFAULT = 64 * AVX2 + 8  # runs on every CPU the extension runs on (tests' baseline form)
# Key segments of 64 << SEGMENT = 256 positions in every form a process runs: a decode row of a
# long context then spreads over the threads (without them it ran ~1.5x slower on 2 threads),
# at one fold per 256 keys.
SEGMENT = 2
_CONTEXTS = (768, 2048)  # keys per timed sequence: a chat context, a long one
_ROWS = (1, 5, 17)  # a decode step, a 4-token verify and a 16-token one
_LAYERS = 8  # distinct caches per pass, so the keys come from memory as in a real step
# Seconds of form timing before no further pass starts: a bound on what a first start waits,
# set beside the kernel tuner's budget (kernels/tuner.py says why a wall-clock cap).
DEFAULT_BUDGET_S = 30.0


def form(isa: int, tile: int, seg: int = 0) -> int:
    return 1024 * seg + 64 * isa + tile


def has_bf16_products(head_dim: int) -> bool:
    """Whether this CPU runs the bfloat16-product form for ``head_dim`` (AVX-512 BF16)."""
    return any(f % 1024 // 64 == BF16_DOT for f in supported_forms(head_dim, torch.bfloat16))


def for_float32_caches(f: int) -> int:
    """The form to run on float32 / float16 caches beside a process's bfloat16-product form
    (a draft model's or an EAGLE head's own cache): the same tile and segments, AVX-512."""
    seg, isa, tile = f // 1024, f % 1024 // 64, f % 64
    return form(AVX512, tile, seg) if isa == BF16_DOT else f


def supported_forms(head_dim: int, cache_dtype: torch.dtype = torch.float32) -> list[int]:
    """Every form this CPU runs for ``head_dim`` and a cache of ``cache_dtype``, DEFAULT first;
    [] without the extension."""
    if not quant_ext.available():
        return []
    ext = quant_ext.load()
    bf16 = cache_dtype == torch.bfloat16
    forms = [form(isa, t, seg) for seg in SEGMENTS for isa in (AVX2, AVX512, BF16_DOT)
             for t in TILES]
    return [f for f in forms if ext.attention_form_supported(f, head_dim, bf16)]


def synthetic_caches(num_kv_heads: int, head_dim: int, layers: int, context: int,
                     block_size: int = 16, generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float32,
                     ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """One sequence of ``context`` positions in a paged cache: random K/V blocks per layer (each
    layer its own, so a pass reads them from memory as a forward does) and its block table."""
    nb = context // block_size + 1
    caches = [(torch.randn(nb, block_size, num_kv_heads, head_dim, generator=generator).to(dtype),
               torch.randn(nb, block_size, num_kv_heads, head_dim, generator=generator).to(dtype))
              for _ in range(layers)]
    return caches, torch.arange(nb, dtype=torch.int32)[None]


def query_rows(num_heads: int, head_dim: int, context: int, rows: int,
               generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, seq_of, pos_of): ``rows`` query rows of that sequence at its last positions (a decode
    step is 1 row, a k-draft verify k + 1)."""
    q = torch.randn(rows, num_heads, head_dim, generator=generator)
    return (q, torch.zeros(rows, dtype=torch.int64),
            torch.arange(context - rows, context, dtype=torch.int64))


def time_forms(num_heads: int, num_kv_heads: int, head_dim: int, forms: list[int],
               repeats: int = 9, cache_dtype: torch.dtype = torch.float32,
               budget_s: float | None = None, clock: Callable[[], float] = time.perf_counter,
               ) -> tuple[dict[int, float], int]:
    """Per form, its cost over the timed cases (a decode row and two verifies, at a short and a
    long context; ``_LAYERS`` layers each): the sum over cases of its fastest pass relative to
    the fastest form's on that case, so a decode row (a fraction of a verify's time) weighs as
    much as a verify. Passes alternate between the forms; after the first timed one, none
    starts once ``budget_s`` seconds (on ``clock``) have passed. Also returns how many timed
    passes ran (``repeats`` unless the budget cut them)."""
    ext = quant_ext.load()
    g = torch.Generator().manual_seed(0)
    cases = []  # (q, caches, block table, seq_of, pos_of)
    for context in _CONTEXTS:
        caches, table = synthetic_caches(num_kv_heads, head_dim, _LAYERS, context, generator=g,
                                         dtype=cache_dtype)
        for rows in _ROWS:
            q, seq_of, pos_of = query_rows(num_heads, head_dim, context, rows, generator=g)
            cases.append((q, caches, table, seq_of, pos_of))
    samples = {f: [[] for _ in cases] for f in forms}
    start = clock()
    timed = 0
    for rep in range(repeats + 1):
        if timed and budget_s is not None and clock() - start >= budget_s:
            break
        timed += rep > 0
        for f in forms if rep % 2 else forms[::-1]:
            for c, (q, caches, table, seq_of, pos_of) in enumerate(cases):
                t0 = clock()
                for k, v in caches:
                    ext.paged_attention(q, k, v, table, seq_of, pos_of, head_dim ** -0.5, 0, f)
                if rep:  # the first pass warms up
                    samples[f][c].append(clock() - t0)
    # The fastest pass, not the median: another process's work only ever adds time (5 tunings
    # in a row: the fastest pass picked the same form 5 times, the median 4).
    fastest = {f: [min(s) for s in per_case] for f, per_case in samples.items()}
    best = [min(m[c] for m in fastest.values()) for c in range(len(cases))]
    return {f: sum(t / b for t, b in zip(m, best)) for f, m in fastest.items()}, timed


def numerics(head_dim: int, cache_dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(isa, seg) of every form this process runs for ``head_dim`` and ``cache_dtype``: what
    decides the bits, from the CPU's instruction sets alone (never from timing). A bfloat16
    cache takes the bfloat16-product form where the CPU has it (the reason ``kv_cache_dtype``
    auto picks that cache), else AVX-512, else AVX2; segments of ``64 << SEGMENT`` keys."""
    forms = supported_forms(head_dim, cache_dtype)
    for isa in ((BF16_DOT, AVX512, AVX2) if cache_dtype == torch.bfloat16 else (AVX512, AVX2)):
        if form(isa, TILES[0], SEGMENT) in forms:
            return isa, SEGMENT
    return AVX2, SEGMENT


def candidate_forms(head_dim: int, cache_dtype: torch.dtype = torch.float32) -> list[int]:
    """The forms of this process's numerics (one per tile): any of them gives the same bits."""
    if not quant_ext.available():
        return []
    isa, seg = numerics(head_dim, cache_dtype)
    forms = supported_forms(head_dim, cache_dtype)
    return [f for f in (form(isa, t, seg) for t in TILES) if f in forms]


def choose_form(num_heads: int, num_kv_heads: int, head_dim: int, cache_dir: Path | None,
                measure: bool = True, cache_dtype: torch.dtype = torch.float32,
                budget_s: float | None = DEFAULT_BUDGET_S,
                clock: Callable[[], float] = time.perf_counter) -> int:
    """The form this process runs for a KV cache of ``cache_dtype``: one of ``candidate_forms``,
    so the same bits whatever is measured. ``measure=False`` (kernel tuning off): the first
    tile, untimed. ``budget_s``: see ``time_forms``."""
    forms = candidate_forms(head_dim, cache_dtype)
    if not forms:
        return DEFAULT
    if not measure or len(forms) < 2:
        return forms[0]
    key = "|".join([cpu_model(), torch.__version__, str(torch.get_num_threads()),
                    f"{num_heads}x{num_kv_heads}x{head_dim}", quant_ext.build_key(),
                    str(cache_dtype)])
    path = None
    if cache_dir is not None:
        path = cache_dir / f"attention-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
        try:
            cached = int(json.loads(path.read_text())["form"])
            if cached in forms:  # a record from before the numerics were fixed is re-timed
                return cached
        except (OSError, ValueError, KeyError, TypeError):
            pass
    repeats = 9
    cost, passes = time_forms(num_heads, num_kv_heads, head_dim, forms, repeats, cache_dtype,
                              budget_s, clock)
    best = min(cost, key=cost.__getitem__)
    log.info("attention form %d from %d of %d timed passes (cost relative to the best per "
             "case: %s)", best, passes, repeats, {f: round(c, 3) for f, c in cost.items()})
    if passes < repeats:
        log.warning("attention tile timing cut by its %.0fs budget: %d of %d passes (the tile "
                    "changes no bits)", budget_s, passes, repeats)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"form": best, "cost": cost, "passes": passes,
                                       "of": repeats}))
            tmp.replace(path)
        except OSError as exc:
            log.warning("could not cache the attention form at %s: %s", path, exc)
    return best
