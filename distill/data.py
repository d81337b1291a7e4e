"""Teacher data: continuations the target itself generates, optionally with its distribution.

The draft learns to predict what the target will say, so the training text is the target's own
output, generated through our batched engine. A conversation has one or more user turns; after
each answer the target's own words go back in as the assistant turn and the next user turn is
asked, so later answers are generated with the target's earlier answers in context. Each answer
is one sequence: the whole rendered conversation so far (the prompt) plus the answer's tokens.

Two modes:
- with logprobs (the draft method's KL loss): every generated token also carries the target's
  top-K log-probabilities at that position (the ``logprobs`` a client could ask for), so no
  second teacher pass is run. About 4 + 6 K = 124 bytes per response token.
- tokens only (``logprobs=False``, ``specserve distill --no-logprobs``): ``top_ids`` and
  ``top_logprobs`` are empty lists, and a trainer that needs the target's distribution or
  features recomputes them from the token ids (the EAGLE head does). 4 bytes per token of a
  sequence: a million response tokens take a few MB.

On disk (``DIR/``), one shard per chunk of conversations, so an interrupted run resumes at the
first missing shard:

    shard-00000.pt   {"tokens": [int32 [P+R]], "prompt_lens": [int], "ids": [str],
                      "top_ids": [int32 [R, K]] or [], "top_logprobs": [float16 [R, K]] or []}
    settings.json    how the shards were made (checked on resume: a folder never mixes modes)

Row r of ``top_*`` is the target's distribution over token P + r given tokens[:P + r]. Ids are
the conversation's id for its first answer and ``<id>/t<n>`` for the n-th (n >= 2).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.core.errors import ConfigError

log = logging.getLogger(__name__)

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.json"
TOP_K = 20  # the most logprobs the engine returns per token (the OpenAI API's limit too)


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    split: str  # "train" | "heldout"
    prompt: str


@dataclass(frozen=True)
class Conversation:
    """User turns the target answers one after another (its answers fed back in between)."""

    id: str
    category: str
    split: str  # "train" | "heldout"
    turns: tuple[str, ...]

    @classmethod
    def from_prompt(cls, p: Prompt) -> Conversation:
        return cls(p.id, p.category, p.split, (p.prompt,))


def load_prompts(path: Path = PROMPTS_FILE, split: str | None = None) -> list[Prompt]:
    """The repository's prompt set (or another file of the same shape), optionally one split."""
    items = [Prompt(**p) for p in json.loads(Path(path).read_text())]
    return [p for p in items if split is None or p.split == split]


@dataclass
class TeacherData:
    """Sequences (prompt + the target's answer), with the target's top-K next-token log-probs
    at each answer position unless the data is tokens-only (then ``top_*`` are empty)."""

    tokens: list[torch.Tensor] = field(default_factory=list)  # int32 [P + R] each
    prompt_lens: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)  # int32 [R, K], or empty
    top_logprobs: list[torch.Tensor] = field(default_factory=list)  # float16 [R, K], or empty

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_response_tokens(self) -> int:
        return sum(len(t) - p for t, p in zip(self.tokens, self.prompt_lens))

    @property
    def has_logprobs(self) -> bool:
        return len(self.top_ids) == len(self.tokens) > 0

    def extend(self, other: TeacherData) -> None:
        if self.tokens and other.tokens and self.has_logprobs != other.has_logprobs:
            raise ConfigError("cannot mix tokens-only teacher data with data that has logprobs")
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


@dataclass(frozen=True)
class GenSettings:
    """What decides a folder's shards; a resumed run must ask for the same."""

    max_tokens: int
    temperature: float
    chunk_size: int
    logprobs: bool

    def check_folder(self, folder: Path) -> None:
        """Writes ``settings.json`` into a new folder; refuses a folder made otherwise."""
        path = folder / "settings.json"
        mine = self.__dict__
        if path.is_file():
            theirs = json.loads(path.read_text())
            if theirs != mine:
                diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
                raise ConfigError(
                    f"{folder} holds teacher data made with other settings (was, now): {diff}; "
                    f"rerun with the same flags (--max-new-tokens, --no-logprobs, "
                    f"--chunk-size) or use a new --out"
                )
        elif any(folder.glob("shard-*.pt")):
            # made before settings.json existed: only logprob shards were made then
            shard = TeacherData.load(min(folder.glob("shard-*.pt")))
            if shard.has_logprobs != self.logprobs:
                raise ConfigError(f"{folder} holds teacher data of the other mode (logprobs "
                                  f"{shard.has_logprobs}); use a new --out")
            path.write_text(json.dumps(mine) + "\n")
        else:
            path.write_text(json.dumps(mine) + "\n")


def _chunks(items: list, size: int) -> Iterator[tuple[int, list]]:
    for n, start in enumerate(range(0, len(items), size)):
        yield n, items[start:start + size]


def generate_teacher_data(
    engine,  # an LLMEngine (typed loosely: importing it here would be circular)
    prompts: list[Prompt] | list[Conversation],
    folder: Path,
    *,
    max_tokens: int,
    temperature: float = 0.0,
    chunk_size: int = 128,
    logprobs: bool = True,
    max_response_tokens: int | None = None,
    deadline: float | None = None,
    stats: dict | None = None,
) -> TeacherData:
    """Generates (or resumes generating) teacher data for ``prompts`` into ``folder``.

    Shard n holds the answers of chunk n (``chunk_size`` conversations). Chunks are not
    barriers: conversations stream through the engine in a window of twice its batch, so while
    the last answers of one chunk finish, the next chunk already fills the batch; each shard is
    written (in order) as soon as its conversations are done.

    No new chunk is started once the folder holds ``max_response_tokens`` answer tokens
    (counting those already generated for chunks in flight), or when it would likely end
    after ``deadline`` (``time.monotonic()``; judged from the time between the last two
    shards). ``stats`` (if given) receives what this call generated: ``sequences``,
    ``response_tokens``, ``prompt_tokens``, ``seconds`` (wall time), ``shards``.
    """
    convs = [Conversation.from_prompt(p) if isinstance(p, Prompt) else p for p in prompts]
    folder.mkdir(parents=True, exist_ok=True)
    GenSettings(max_tokens, temperature, chunk_size, logprobs).check_folder(folder)
    todo: list[tuple[Path, list[Conversation]]] = []
    have = 0  # answer tokens in the folder's shards
    for n, chunk in _chunks(convs, chunk_size):
        shard = folder / f"shard-{n:05d}.pt"
        if shard.exists():
            done = TeacherData.load(shard)
            _check_shard(shard, done, chunk)
            have += done.num_response_tokens
        else:
            todo.append((shard, chunk))
    gen = _StreamingGenerator(engine, max_tokens, temperature, logprobs)
    made = gen.run(todo, have, max_response_tokens, deadline)
    if stats is not None:
        stats.update(made)
    return TeacherData.load_dir(folder)


def _check_shard(path: Path, data: TeacherData, chunk: list[Conversation]) -> None:
    """A resumed shard must belong to the same conversations (same prompt set and order)."""
    expected = {c.id for c in chunk}
    found = {i.split("/t")[0] for i in data.ids}
    if not found <= expected:
        raise ConfigError(f"{path} was made from other prompts than this run's chunk "
                          f"(e.g. {sorted(found - expected)[:3]}); use the same prompt flags "
                          f"or a new --out")


@dataclass
class _Chunk:
    shard: Path
    convs: list[Conversation]
    open: int  # conversations not finished yet
    answers: dict[tuple[str, int], tuple[list[int], Any]] = field(default_factory=dict)


class _StreamingGenerator:
    """Feeds conversations through the engine (every turn as soon as the previous answer is
    done) and writes each chunk's shard in order once all its conversations are finished."""

    def __init__(self, engine, max_tokens: int, temperature: float, logprobs: bool) -> None:
        from specserve.core.sampling_params import SamplingParams

        self.engine = engine
        self.logprobs = logprobs
        self.params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                     logprobs=TOP_K if logprobs else None, seed=None)
        self.window = 2 * engine.config.max_num_seqs  # most conversations in flight
        self.in_flight = 0
        self.live_tokens = 0  # answer tokens collected for shards not written yet
        self.max_len = engine.config.max_model_len
        # request id -> (chunk, conversation, turn, prompt ids, merger, chat so far)
        self.pending: dict[str, tuple[_Chunk, Conversation, int, list[int], Any, list]] = {}

    def run(self, todo: list[tuple[Path, list[Conversation]]], have: int,
            budget: int | None, deadline: float | None) -> dict:
        made = {"sequences": 0, "response_tokens": 0, "prompt_tokens": 0, "seconds": 0.0,
                "shards": 0}
        t0 = last_save = time.monotonic()
        shard_seconds = 0.0  # time between the last two shard writes: the next one's estimate
        shard_tokens = 0  # answer tokens of the last shard written
        admitted: list[_Chunk] = []  # in order; the head is the next shard to write
        queue: list[tuple[_Chunk, Conversation]] = []  # admitted, not yet submitted
        bar = tqdm(total=sum(len(c) for _, c in todo), desc="teacher data", unit="conv",
                   dynamic_ncols=True)
        while True:
            # start chunks while the window has room and the budget and the deadline allow
            while todo and len(queue) + self.in_flight < self.window:
                if budget is not None and have + self.live_tokens >= budget:
                    todo.clear()
                    break
                # it ends after the chunks already admitted: about one shard interval each
                ends = time.monotonic() + (len(admitted) + 1) * shard_seconds
                if deadline is not None and ends > deadline:
                    log.info("not starting %s: it would end after the deadline", todo[0][0].name)
                    todo.clear()
                    break
                shard, convs = todo.pop(0)
                chunk = _Chunk(shard, convs, len(convs))
                admitted.append(chunk)
                queue.extend((chunk, c) for c in convs)
            while queue and self.in_flight < self.window:
                chunk, conv = queue.pop(0)
                self.in_flight += 1
                if not self._submit(chunk, conv, 0, []):
                    self._finish(chunk, bar)
            while admitted and admitted[0].open == 0:  # write finished shards in order
                data = self._shard(admitted.pop(0))
                now = time.monotonic()
                shard_seconds, last_save = now - last_save, now
                shard_tokens = data.num_response_tokens
                have += shard_tokens
                self.live_tokens -= shard_tokens
                made["sequences"] += len(data)
                made["response_tokens"] += shard_tokens
                made["prompt_tokens"] += sum(data.prompt_lens)
                made["shards"] += 1
                bar.set_postfix(tokens=have, tok_s=f"{made['response_tokens'] / (now - t0):.0f}")
            if not self.engine.has_unfinished():
                if not queue and not todo:
                    break
                continue
            for out in self.engine.step():
                self._collect(out, bar)
        bar.close()
        made["seconds"] = last_save - t0
        return made

    def _submit(self, chunk: _Chunk, conv: Conversation, turn: int, chat: list) -> bool:
        chat = chat + [{"role": "user", "content": conv.turns[turn]}]
        ids = self.engine.encode(self.engine.render_chat(chat))
        if len(ids) + 1 >= self.max_len:  # no room for an answer: the conversation ends here
            return False
        rid = f"teacher-{chunk.shard.stem}-{conv.id}-{turn}"
        from specserve.engine.outputs import OutputMerger

        self.pending[rid] = (chunk, conv, turn, ids, OutputMerger(), chat)
        self.engine.add_request(rid, ids, self.params)
        return True

    def _collect(self, out, bar) -> None:
        if out.request_id not in self.pending:
            return
        chunk, conv, turn, ids, merger, chat = self.pending[out.request_id]
        merger.add(out)
        if not out.finished:
            return
        del self.pending[out.request_id]
        full = merger.take()
        if full.token_ids:
            chunk.answers[(conv.id, turn)] = (ids, full)
            self.live_tokens += len(full.token_ids)
            if turn + 1 < len(conv.turns):
                chat = chat + [{"role": "assistant", "content": full.text}]
                if self._submit(chunk, conv, turn + 1, chat):
                    return
        self._finish(chunk, bar)

    def _finish(self, chunk: _Chunk, bar) -> None:
        self.in_flight -= 1
        chunk.open -= 1
        bar.update(1)

    def _shard(self, chunk: _Chunk) -> TeacherData:
        data = TeacherData()
        for conv in chunk.convs:  # a stable order: conversations as given, turns in order
            for turn in range(len(conv.turns)):
                if (conv.id, turn) not in chunk.answers:
                    break
                ids, out = chunk.answers[(conv.id, turn)]
                data.tokens.append(torch.tensor(ids + out.token_ids, dtype=torch.int32))
                data.prompt_lens.append(len(ids))
                data.ids.append(conv.id if turn == 0 else f"{conv.id}/t{turn + 1}")
                if self.logprobs:
                    data.top_ids.append(torch.tensor(
                        [[t for t, _ in lp.top] for lp in out.logprobs], dtype=torch.int32))
                    data.top_logprobs.append(torch.tensor(
                        [[v for _, v in lp.top] for lp in out.logprobs], dtype=torch.float16))
        data.save(chunk.shard)
        return data
