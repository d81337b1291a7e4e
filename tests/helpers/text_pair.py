"""A target and a draft with different real tokenizers that agree on TEXT, for the
cross-tokenizer draft's tests.

The target speaks a small byte-level BPE trained here (``small_bpe_tokenizer``: emoji and CJK
stay split into byte tokens), the draft the default model's tokenizer (49152 tokens). Each is a
bigram model made by hand: attention and MLP write nothing, so the next token's logits depend on
the current token alone, and each token of a cycle of text points at the next one. Both learn
the same cycle, each in its own tokens, except where ``draft_text`` differs: there the draft is
wrong once per cycle, so its drafts are both accepted and rejected.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

CYCLE = "def(x): return 😀+中文*y\n"
DRAFT_CYCLE = "def(x): yield 😀+中文*y\n"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = ("the quick brown fox jumps over the lazy dog; def return add print if else "
           "for while x y z = + - * / ( ) : , . \n") * 20


def small_bpe_tokenizer(specials: list[str] = SPECIALS):
    """A byte-level BPE of 320 tokens trained on a few English and code words (no download).
    ``specials`` in another order give the same size with other ids for them (the other
    tokens' ids stay)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")


def cycle_tokens(tokenizer, text: str) -> list[int]:
    """The cycle's tokens; the text repeated must tokenize as the tokens repeated, each token
    once per cycle (a bigram model can follow it then)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    again = tokenizer(text * 3, add_special_tokens=False)["input_ids"]
    assert again == ids * 3, "the cycle must tokenize the same way every time round"
    assert len(set(ids)) == len(ids), "each token once per cycle"
    return ids


def bigram_model(path: Path, tokenizer, text: str, *, hidden: int = 64, margin: float = 6.0,
                 seed: int = 0) -> torch.nn.Module:
    """A Llama whose next token after each token of ``text``'s cycle is the cycle's next one
    (by ``margin`` logits over the rest); written to ``path`` with ``tokenizer``."""
    ids = cycle_tokens(tokenizer, text)
    assert len(ids) <= hidden
    vocab = len(tokenizer)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=False,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()  # attention writes nothing
        layer.mlp.down_proj.weight.zero_()  # nor does the MLP: the residual is the embedding
        emb = torch.randn(vocab, hidden, generator=g)
        basis, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=g))
        for j, t in enumerate(ids):
            emb[t] = basis[j] * hidden**0.5  # unit RMS: the final norm leaves it as it is
        head = 0.1 * torch.randn(vocab, hidden, generator=g)
        for j in range(len(ids)):
            head[ids[(j + 1) % len(ids)]] += margin * basis[j] / hidden**0.5
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
