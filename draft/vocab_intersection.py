"""The tokens two vocabularies share: the same byte string in both (token-level intersection,
Timor et al., ICML 2025), as a draft id <-> target id map built once at load.

A token's bytes come from its piece in the tokenizer's model vocabulary, read the way its
decoder reads it: byte-level BPE pieces (GPT-2's alphabet, ``Ġ`` for a space) through the
byte-to-unicode table; SentencePiece pieces with ``▁`` for a space, and ``<0xNN>`` byte pieces
as that one byte. A byte token (part of a UTF-8 character) is the byte itself, so it maps only
to the other side's token of that same byte. Special and added tokens are left out (their
text is a control string, not what the piece means to the model), and so is any token whose
bytes cannot be established: a smaller intersection costs acceptance, never exactness (the
verify keeps the target's distribution for any draft distribution).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class VocabIntersection:
    """Row n of the intersection is draft token ``draft_ids[n]`` = target token
    ``target_ids[n]``; ``to_draft[t]`` is the draft id of target token t (-1 outside)."""

    draft_ids: torch.Tensor  # [N] int64
    target_ids: torch.Tensor  # [N] int64
    to_draft: torch.Tensor  # [V_target] int64, -1 where the target token is not shared

    def __len__(self) -> int:
        return int(self.draft_ids.numel())

    @classmethod
    def of(cls, draft_tokenizer: Any, target_tokenizer: Any, draft_vocab: int,
           target_vocab: int) -> VocabIntersection:
        """``*_vocab``: the models' logits widths (a model may pad its vocabulary past its
        tokenizer's; ids at or past the width are left out)."""
        draft = _by_bytes(token_bytes(draft_tokenizer), draft_vocab)
        target = _by_bytes(token_bytes(target_tokenizer), target_vocab)
        pairs = sorted((d, target[b]) for b, d in draft.items() if b in target)
        d_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
        t_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)
        to_draft = torch.full((target_vocab,), -1, dtype=torch.long)
        to_draft[t_ids] = d_ids
        return cls(d_ids, t_ids, to_draft)


def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Token id -> its bytes, for the tokens of the model vocabulary whose bytes are known
    (no special or added tokens). Empty for a tokenizer of a kind not read here."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {}
    spec = json.loads(backend.to_str())
    pieces = _pieces(spec.get("model") or {})
    excluded = {int(t["id"]) for t in spec.get("added_tokens") or ()}
    excluded |= {int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()}
    to_bytes = _piece_reader(spec.get("decoder"))
    if to_bytes is None:
        return {}
    out: dict[int, bytes] = {}
    for piece, i in pieces.items():
        if i in excluded:
            continue
        b = to_bytes(piece)
        if b:
            out[i] = b
    return out


def _pieces(model: dict) -> dict[str, int]:
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # BPE, WordLevel, WordPiece
        return {str(p): int(i) for p, i in vocab.items()}
    if isinstance(vocab, list):  # Unigram: [piece, score] in id order
        return {str(entry[0]): i for i, entry in enumerate(vocab)}
    return {}


def _decoder_steps(decoder: dict | None) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders") or () for s in _decoder_steps(d)]
    return [decoder]


def _piece_reader(decoder: dict | None):
    """A piece -> bytes function for this decoder (None: a decoder not read here). Strip-like
    steps (a SentencePiece decode dropping the text's first space) act on whole texts, not on
    what a piece means, so they are not applied."""
    steps = _decoder_steps(decoder)
    kinds = {s.get("type") for s in steps}
    if "ByteLevel" in kinds:
        table = {c: b for b, c in byte_to_unicode().items()}

        def byte_level(piece: str) -> bytes | None:
            try:
                return bytes(table[c] for c in piece)
            except KeyError:
                return None

        return byte_level
    spaces = [s.get("replacement", "▁") for s in steps if s.get("type") == "Metaspace"]
    spaces += [s["pattern"]["String"] for s in steps if s.get("type") == "Replace"
               and s.get("content") == " " and "String" in (s.get("pattern") or {})]
    if not spaces and "ByteFallback" not in kinds:
        return None
    fallback = "ByteFallback" in kinds

    def sentencepiece(piece: str) -> bytes | None:
        m = _BYTE_PIECE.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)]) if fallback else None
        for s in spaces:
            piece = piece.replace(s, " ")
        return piece.encode("utf-8")

    return sentencepiece


def _by_bytes(tokens: dict[int, bytes], vocab: int) -> dict[bytes, int]:
    """One id per byte string (a SentencePiece vocabulary may hold ``▁`` and ``<0x20>``
    both): the lowest id wins, so the map is one-to-one."""
    out: dict[bytes, int] = {}
    for i in sorted(tokens):
        if i < vocab:
            out.setdefault(tokens[i], i)
    return out


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others
    (controls, space, a few more) for the code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return dict(sorted(out.items()))
