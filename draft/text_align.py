"""Text between two tokenizers: the target's tokens as text, that text as the draft's tokens,
and the draft's text back as target tokens that extend the target's sequence.

Everything here works on a short window at the end of a sequence, never on its whole text:
tokenization is local (a tokenizer's pre-tokenizer splits text at spaces, punctuation and
digits, so re-tokenizing a tail from a token boundary gives the tokens a whole-text pass gives
there), and a byte-level token that ends inside a multi-byte UTF-8 character decodes to U+FFFD
until the character is complete, which the window detects and holds back.

Token ends are character offsets (Python string indices) into the sequence's text. Tokens that
split one character into bytes share that character's end, so an end marks a safe cut only
where it is strictly below the next token's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_REPLACEMENT = "\ufffd"
# Target tokens decoded before the new ones: their text is the base the new text is cut from
# (a SentencePiece decode drops the first token's leading space, so that token must be old).
_CONTEXT = 4
# A UTF-8 character is at most 4 bytes: a tail that still decodes to U+FFFD after this many
# tokens holds an invalid byte, not an unfinished character.
_MAX_HELD = 4


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Special tokens stay as their text: ``<|im_start|>`` in a chat prompt is text the other
    tokenizer may know as one of its own special tokens."""
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def encode(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """(token ids, end offset of each token in ``text``); special-token strings become their
    ids, no BOS/EOS is added."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [int(e) for _, e in enc["offset_mapping"]]


@dataclass
class TargetText:
    """The target's token ids as text, read incrementally: ``read`` tokens are in the text,
    decoded from ``prefix`` on (the few before ``read`` give the new text its left context)."""

    prefix: int = 0
    read: int = 0

    def advance(self, tokenizer: Any, ids: Sequence[int], end: int) -> str:
        """The text of ``ids[read:end]`` that is complete (no unfinished character at its
        end); the tokens of an unfinished character wait for the ones that finish it."""
        if end <= self.read:
            return ""
        base = decode(tokenizer, ids[self.prefix : self.read])
        full, m = "", self.read
        for m in range(end, max(self.read, end - _MAX_HELD), -1):
            full = decode(tokenizer, ids[self.prefix : m])
            if not full.endswith(_REPLACEMENT):
                break
        else:
            if end - self.read <= _MAX_HELD:
                return ""  # an unfinished character: wait for its last bytes
            m = end - _MAX_HELD  # invalid bytes, not an unfinished character: take them
            full = decode(tokenizer, ids[self.prefix : m])
        # a concatenative decoder always extends ``base``; were one not to, the text goes on
        # from where the two agree (the draft's context is off by a little, never stuck)
        start = len(base) if full.startswith(base) else common_prefix(base, full)
        self.prefix, self.read = max(self.prefix, m - _CONTEXT), m
        return full[start:]


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def target_continuation(tokenizer: Any, ids: Sequence[int], text: str, *, final: bool,
                        special_ids: frozenset[int]) -> list[int]:
    """Target tokens that extend ``ids`` by (a prefix of) ``text``, the draft's text after
    the target's complete text. The last tokens of ``ids`` are decoded and re-tokenized
    together with ``text``; the re-tokenization must reproduce them exactly, and what follows
    them is the continuation. When it does not (the target stopped mid-word where a whole-text
    tokenization would merge across), ``text`` alone is tokenized, kept only if the two
    decode to exactly the window's text followed by ``text``.

    Unless ``final`` (the draft ended its text), the tokens that may still change when more
    text follows are dropped: those of the text's last pre-token (a word may go on, a run of
    spaces splits differently in front of a word), found by the tokenizer's own pre-tokenizer;
    without one, the last token and whitespace-only ones before it. A special token at the
    end never merges: it stays."""
    n = len(ids)
    s = max(0, n - _CONTEXT)
    window = decode(tokenizer, ids[s:n])
    while s > 0 and window.startswith(_REPLACEMENT) and n - s < 2 * _CONTEXT:
        s -= 1  # the window starts inside a character: widen it to the character's start
        window = decode(tokenizer, ids[s:n])
    complete = window.rstrip(_REPLACEMENT)  # the bytes of an unfinished character are held
    out: list[int] = []
    ends: list[int] = []  # of ``out``, in the text ``complete + text``
    joined, joined_ends = encode(tokenizer, complete + text)
    if joined[: n - s] == list(ids[s:n]):
        out, ends = joined[n - s:], joined_ends[n - s:]
    elif complete == window:
        alone, alone_ends = encode(tokenizer, text)
        if alone and decode(tokenizer, [*ids[s:n], *alone]) == window + text:
            out, ends = alone, [len(complete) + e for e in alone_ends]
    if final or not out or out[-1] in special_ids:
        return out
    cut = _last_piece_start(tokenizer, complete + text)
    if cut is not None:
        while out and ends[-1] > cut:
            out.pop()
            ends.pop()
        return out
    out.pop()
    while out and out[-1] not in special_ids and not decode(tokenizer, out[-1:]).strip():
        out.pop()
    return out


def _last_piece_start(tokenizer: Any, text: str) -> int | None:
    """Where the tokenizer's pre-tokenizer starts the last piece of ``text`` (None: it has
    none we can run)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is None:
        return None
    pieces = pre.pre_tokenize_str(text)
    return int(pieces[-1][1][0]) if pieces else 0
