"""Which form of the C++ paged attention a process runs, measured: ``64 * isa + tile``, isa 0
(AVX2) or 1 (AVX-512), tile the query positions per work item (8 or 16).

The two ISAs sum in different orders, so a process must use one form for every call (a verify
row then equals the decode row at its position, bit for bit); which is faster depends on the CPU
(AVX-512 runs at full width on Zen 5, double-pumped on Zen 4, at lower clocks on some Xeons), and
so does the tile (larger tiles re-read keys less, smaller ones split a verify over more threads).
Tiles change no bits. So the first engine on a machine times every form on the model's attention
shape, at a decode row and two verifies over a synthetic paged cache, and keeps the fastest; the
choice is cached per CPU model, torch threads, shape and extension build under
``$SPECSERVE_CACHE_DIR/tune``, so every later start (and every server restart) runs the same form
and gives the same bits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from specserve.kernels import quant_ext
from specserve.kernels.tuner import cpu_model

log = logging.getLogger(__name__)

AVX2, AVX512 = 0, 1  # isa
TILES = (8, 16)
DEFAULT = 64 * AVX2 + 8  # untimed (kernel tuning off): runs on every CPU the extension runs on
_CONTEXT = 768  # keys per timed sequence: a few L1 chunks, a typical chat context
_ROWS = (1, 5, 17)  # a decode step, a 4-token verify and a 16-token one
_LAYERS = 8  # distinct caches per pass, so the keys come from memory as in a real step


def form(isa: int, tile: int) -> int:
    return 64 * isa + tile


def supported_forms(head_dim: int) -> list[int]:
    """Every form this CPU runs for ``head_dim``, DEFAULT first; [] without the extension."""
    if not quant_ext.available():
        return []
    ext = quant_ext.load()
    forms = [form(isa, t) for isa in (AVX2, AVX512) for t in TILES]
    return [f for f in forms if ext.attention_form_supported(f, head_dim)]


def time_forms(num_heads: int, num_kv_heads: int, head_dim: int, forms: list[int],
               repeats: int = 9) -> dict[int, float]:
    """Median seconds of one pass (``_LAYERS`` layers, each row count of ``_ROWS``) per form,
    passes alternating between the forms."""
    ext = quant_ext.load()
    bs = 16
    nb = _CONTEXT // bs + 1
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(nb, bs, num_kv_heads, head_dim, generator=g),
               torch.randn(nb, bs, num_kv_heads, head_dim, generator=g)) for _ in range(_LAYERS)]
    table = torch.arange(nb, dtype=torch.int32)[None]
    cases = []
    for rows in _ROWS:
        q = torch.randn(rows, num_heads, head_dim, generator=g)
        seq_of = torch.zeros(rows, dtype=torch.int64)
        pos_of = torch.arange(_CONTEXT - rows, _CONTEXT, dtype=torch.int64)
        cases.append((q, seq_of, pos_of))
    samples: dict[int, list[float]] = {f: [] for f in forms}
    for rep in range(repeats + 1):
        for f in forms if rep % 2 else forms[::-1]:
            t0 = time.perf_counter()
            for q, seq_of, pos_of in cases:
                for k, v in caches:
                    ext.paged_attention(q, k, v, table, seq_of, pos_of, head_dim ** -0.5, 0, f)
            if rep:  # the first pass warms up
                samples[f].append(time.perf_counter() - t0)
    return {f: statistics.median(s) for f, s in samples.items()}


def choose_form(num_heads: int, num_kv_heads: int, head_dim: int, cache_dir: Path | None,
                measure: bool = True) -> int:
    """The form this process runs. ``measure=False`` (kernel tuning off): DEFAULT, which runs
    everywhere, so the choice never depends on timing noise."""
    forms = supported_forms(head_dim)
    if not measure or len(forms) < 2:
        return DEFAULT
    key = "|".join([cpu_model(), torch.__version__, str(torch.get_num_threads()),
                    f"{num_heads}x{num_kv_heads}x{head_dim}", quant_ext.build_key()])
    path = None
    if cache_dir is not None:
        path = cache_dir / f"attention-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
        try:
            cached = int(json.loads(path.read_text())["form"])
            if cached in forms:
                return cached
        except (OSError, ValueError, KeyError, TypeError):
            pass
    seconds = time_forms(num_heads, num_kv_heads, head_dim, forms)
    best = min(seconds, key=seconds.__getitem__)
    log.info("attention form %d (seconds per pass: %s)", best,
             {f: round(s, 5) for f, s in seconds.items()})
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"form": best, "seconds": seconds}))
            tmp.replace(path)
        except OSError as exc:
            log.warning("could not cache the attention form at %s: %s", path, exc)
    return best
