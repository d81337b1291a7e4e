"""The tokens two vocabularies share (token-level intersection's map): a token's bytes equal
what its own tokenizer decodes it to, tokens map iff their bytes are equal, special tokens never
map, a byte token (part of a UTF-8 character) maps only to the same byte, and SentencePiece
pieces (``▁``, ``<0xNN>``) read as bytes the way a byte-level BPE's do."""

from __future__ import annotations

import pytest

from specserve.draft.vocab_intersection import VocabIntersection, byte_to_unicode, token_bytes
from tests.helpers.text_pair import SPECIALS, small_bpe_tokenizer
from tests.helpers.tiny_models import default_tokenizer


@pytest.fixture(scope="module")
def tokenizers():
    return default_tokenizer(), small_bpe_tokenizer()


def _pieces(tok) -> dict[str, int]:
    return {p: i for i, p in enumerate(tok.convert_ids_to_tokens(list(range(len(tok)))))}


def test_token_bytes_are_what_the_tokenizer_decodes(tokenizers):
    """Independent reference: the tokenizer's own decode of each token alone (where it is a
    whole UTF-8 text); the others are partial characters, checked as raw bytes."""
    for tok in tokenizers:
        got = token_bytes(tok)
        specials = set(tok.all_special_ids)
        assert specials and not specials & set(got)
        assert len(got) == len(tok) - len(tok.get_added_vocab())
        partial = 0
        for i, b in got.items():
            text = tok.decode([i])
            if "\ufffd" in text:
                partial += 1
                assert b.decode("utf-8", errors="replace") == text
            else:
                assert text.encode() == b, (i, text, b)
        assert partial > 0  # byte tokens of multi-byte characters are in the vocabularies


def test_shared_tokens_are_those_of_equal_bytes(tokenizers):
    """SmolLM2's tokenizer (the draft) against the small BPE (the target): both byte-level, so
    equal bytes are equal pieces; every such non-special pair maps, one to one, nothing else."""
    draft, target = tokenizers
    shared = VocabIntersection.of(draft, target, len(draft), len(target))
    d_pieces, t_pieces = _pieces(draft), _pieces(target)
    specials = set(SPECIALS)
    expected = {(d_pieces[p], t) for p, t in t_pieces.items()
                if p in d_pieces and p not in specials}
    got = set(zip(shared.draft_ids.tolist(), shared.target_ids.tolist()))
    assert got == expected and len(got) > 250
    assert len(set(shared.draft_ids.tolist())) == len(shared) == len(
        set(shared.target_ids.tolist()))
    for d, t in got:
        assert draft.convert_ids_to_tokens(d) == target.convert_ids_to_tokens(t)
        assert shared.to_draft[t] == d
    outside = set(range(len(target))) - {t for _, t in got}
    assert all(shared.to_draft[t] == -1 for t in outside)
    # special tokens both have, at different ids, never map
    for s in SPECIALS:
        assert shared.to_draft[target.convert_tokens_to_ids(s)] == -1
    # a token only one side has does not map: SmolLM2's "Ġyield" is no piece of the BPE
    assert "Ġyield" in d_pieces and "Ġyield" not in t_pieces
    assert d_pieces["Ġyield"] not in shared.draft_ids.tolist()


def test_byte_tokens_map_only_to_the_same_byte(tokenizers):
    """Each single-byte token (the 256 pieces of the byte alphabet) maps to the other side's
    token of that byte, e.g. the emoji's first byte 0xF0 to 0xF0, never to another byte."""
    draft, target = tokenizers
    shared = VocabIntersection.of(draft, target, len(draft), len(target))
    d_pieces, t_pieces = _pieces(draft), _pieces(target)
    alphabet = byte_to_unicode()
    assert len(set(alphabet.values())) == 256
    d_bytes = token_bytes(draft)
    both = 0
    for b, c in alphabet.items():
        t = t_pieces[c]  # the BPE has every byte; SmolLM2 lacks a few control bytes
        assert token_bytes(target)[t] == bytes([b])
        d = int(shared.to_draft[t])
        if c in d_pieces:
            assert d == d_pieces[c] and d_bytes[d] == bytes([b]), b
            both += 1
        else:
            assert d == -1, b
    assert both > 200
    # the emoji's first byte maps to the draft's one-byte token, not to one holding more bytes
    # of the emoji (SmolLM2 has "ðŁ", 0xF0 0x9F, which the BPE lacks)
    first = int(shared.to_draft[t_pieces[alphabet[0xF0]]])
    assert d_bytes[first] == b"\xf0" and "ðŁ" in d_pieces and "ðŁ" not in t_pieces
    assert d_pieces["ðŁ"] not in shared.draft_ids.tolist()


def _sentencepiece_tokenizer():
    """A SentencePiece-style BPE (``▁`` for a space, ``<0xNN>`` byte fallback), built by
    hand: Llama's layout."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "▁", "▁t", "▁th", "▁the", "he", "t", "h", "e", "ret", "urn", "▁def", "(", "x"]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("h", "e")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                               unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    return out, vocab


def test_sentencepiece_pieces_read_as_bytes(tokenizers):
    """``▁the`` is b" the" (SmolLM2's ``Ġthe``), ``<0xF0>`` the byte 0xF0 (SmolLM2's byte token
    for it), ``<0x20>`` and ``▁`` both b" ": one of them maps (the map is one to one); the
    special tokens do not."""
    draft, _ = tokenizers
    sp, vocab = _sentencepiece_tokenizer()
    got = token_bytes(sp)
    assert got[vocab["▁the"]] == b" the" and got[vocab["<0xF0>"]] == b"\xf0"
    assert got[vocab["<0x20>"]] == got[vocab["▁"]] == b" "
    assert not {vocab["<unk>"], vocab["<s>"], vocab["</s>"]} & set(got)
    shared = VocabIntersection.of(draft, sp, len(draft), len(sp))
    d_pieces = _pieces(draft)
    assert int(shared.to_draft[vocab["▁the"]]) == d_pieces["Ġthe"]
    assert int(shared.to_draft[vocab["<0xF0>"]]) == d_pieces[byte_to_unicode()[0xF0]]
    assert int(shared.to_draft[vocab["ret"]]) == d_pieces["ret"]
    space = [int(shared.to_draft[vocab[p]]) for p in ("<0x20>", "▁")]
    assert sorted(space) == [-1, d_pieces["Ġ"]]
    for s in ("<unk>", "<s>", "</s>"):
        assert shared.to_draft[vocab[s]] == -1
    # the other way round (SentencePiece drafting for the byte-level target) is the same map
    back = VocabIntersection.of(sp, draft, len(sp), len(draft))
    assert sorted(zip(back.target_ids.tolist(), back.draft_ids.tolist())) == sorted(
        zip(shared.draft_ids.tolist(), shared.target_ids.tolist()))


def test_ids_past_a_models_logits_width_are_left_out(tokenizers):
    draft, target = tokenizers
    shared = VocabIntersection.of(draft, target, len(draft), 100)
    assert len(shared) and int(shared.target_ids.max()) < 100
    assert shared.to_draft.shape == (100,)
