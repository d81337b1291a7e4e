"""Teacher data: continuations the target itself generates, with its next-token distribution.

The draft learns to predict what the target will say, so the training text is the target's own
output for the prompts in ``distill/prompts.json``, generated through our batched engine. With
every generated token the engine also returns the target's top-K log-probabilities at that
position (the ``logprobs`` a client could ask for), which is the soft label the KL loss needs;
no second teacher pass is run.

On disk (``DIR/data/``), one shard per chunk of prompts, so an interrupted run resumes at the
first missing shard:

    shard-00000.pt   {"tokens": [int32 [P+R]], "prompt_lens": [int], "ids": [str],
                      "top_ids": [int32 [R, K]], "top_logprobs": [float16 [R, K]]}

Row r of ``top_*`` is the target's distribution over token P + r given tokens[:P + r].
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

log = logging.getLogger(__name__)

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.json"
TOP_K = 20  # the most logprobs the engine returns per token (the OpenAI API's limit too)


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    split: str  # "train" | "heldout"
    prompt: str


def load_prompts(path: Path = PROMPTS_FILE, split: str | None = None) -> list[Prompt]:
    """The repository's prompt set (or another file of the same shape), optionally one split."""
    items = [Prompt(**p) for p in json.loads(Path(path).read_text())]
    return [p for p in items if split is None or p.split == split]


@dataclass
class TeacherData:
    """Sequences with the target's top-K next-token log-probs at each response position."""

    tokens: list[torch.Tensor] = field(default_factory=list)  # int32 [P + R] each
    prompt_lens: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)  # int32 [R, K]
    top_logprobs: list[torch.Tensor] = field(default_factory=list)  # float16 [R, K]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_response_tokens(self) -> int:
        return sum(len(t) for t in self.top_ids)

    def extend(self, other: TeacherData) -> None:
        for name in ("tokens", "prompt_lens", "ids", "top_ids", "top_logprobs"):
            getattr(self, name).extend(getattr(other, name))

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(self.__dict__, tmp)
        tmp.rename(path)  # a shard is either whole or absent

    @classmethod
    def load(cls, path: Path) -> TeacherData:
        return cls(**torch.load(path, weights_only=True))

    @classmethod
    def load_dir(cls, folder: Path) -> TeacherData:
        data = cls()
        for shard in sorted(Path(folder).glob("shard-*.pt")):
            data.extend(cls.load(shard))
        return data


def _chunks(items: list[Prompt], size: int) -> Iterator[tuple[int, list[Prompt]]]:
    for n, start in enumerate(range(0, len(items), size)):
        yield n, items[start:start + size]


def generate_teacher_data(
    engine,  # specserve.engine.LLMEngine (typed loosely: importing it here would be circular)
    prompts: list[Prompt],
    folder: Path,
    *,
    max_tokens: int,
    temperature: float = 0.0,
    chunk_size: int = 128,
) -> TeacherData:
    """Generates (or resumes generating) teacher data for ``prompts`` into ``folder``."""
    from specserve.sampling_params import SamplingParams

    folder.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, logprobs=TOP_K, seed=None
    )
    chunks = list(_chunks(prompts, chunk_size))
    bar = tqdm(total=len(prompts), desc="teacher data", unit="prompt", dynamic_ncols=True)
    made_tokens = 0
    for n, chunk in chunks:
        shard = folder / f"shard-{n:05d}.pt"
        if shard.exists():
            bar.update(len(chunk))
            continue
        encoded = [
            engine.encode(engine.render_chat([{"role": "user", "content": p.prompt}]))
            for p in chunk
        ]
        outs = engine.generate(encoded, params)
        data = TeacherData()
        for p, ids, out in zip(chunk, encoded, outs):
            if not out.token_ids or out.logprobs is None:
                continue
            top_ids = [[t for t, _ in lp.top] for lp in out.logprobs]
            top_lp = [[v for _, v in lp.top] for lp in out.logprobs]
            data.tokens.append(torch.tensor(ids + out.token_ids, dtype=torch.int32))
            data.prompt_lens.append(len(ids))
            data.ids.append(p.id)
            data.top_ids.append(torch.tensor(top_ids, dtype=torch.int32))
            data.top_logprobs.append(torch.tensor(top_lp, dtype=torch.float16))
        data.save(shard)
        made_tokens += data.num_response_tokens
        bar.update(len(chunk))
        bar.set_postfix(tokens=made_tokens)
    bar.close()
    return TeacherData.load_dir(folder)
