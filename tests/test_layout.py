"""BatchLayout: the one flattening of a step. Checked against the lists written out by hand
(the module docstring's worked example) and against ``AttentionMetadata.build`` fed those lists
directly; a forward over a layout equals a forward over the same inputs built by hand."""

from __future__ import annotations

import torch

from specserve.kernels.metadata import AttentionMetadata
from specserve.target.layout import Chunk, build_layout
from specserve.target.loader import build_model
from specserve.target.model_runner import ModelRunner
from tests.helpers.tiny_models import BASE, build_tiny_model, tiny_config


def test_worked_example():
    verify = Chunk([19, 41, 42], start=9, block_table=[7, 2, 5], num_logits=3)
    prefill = Chunk([30, 31, 32, 33], start=0, block_table=[4])
    layout = build_layout([verify, prefill], block_size=4, device="cpu")
    assert layout.input_ids.tolist() == [19, 41, 42, 30, 31, 32, 33]
    assert layout.positions.tolist() == [9, 10, 11, 0, 1, 2, 3]
    assert layout.logits_indices.tolist() == [0, 1, 2]
    assert [layout.token_span(b) for b in range(2)] == [(0, 3), (3, 7)]
    assert [layout.logits_span(b) for b in range(2)] == [(0, 3), (3, 3)]
    assert layout.token_rows([1]).tolist() == [3, 4, 5, 6]
    assert layout.num_tokens == 7 and layout.num_chunks == 2
    ref = AttentionMetadata.build([3, 4], [12, 4], [[7, 2, 5], [4]], 4)
    assert layout.meta.query_lens_cpu == ref.query_lens_cpu
    assert layout.meta.context_lens_cpu == ref.context_lens_cpu
    # positions 9, 10, 11: the table's third block (5), offsets 1..3; 0..3: block 4
    assert layout.meta.slot_mapping.tolist() == [21, 22, 23, 16, 17, 18, 19]
    for name in ("slot_mapping", "cu_seqlens_q", "context_lens", "block_tables"):
        assert torch.equal(getattr(layout.meta, name), getattr(ref, name)), name


def test_run_over_a_layout_equals_forward_by_hand(tmp_path):
    build_tiny_model(tmp_path, tiny_config())
    cfg, model = build_model(tmp_path, torch.float32, "cpu")
    runner = ModelRunner(cfg, model, num_blocks=16, block_size=4, dtype=torch.float32,
                         device="cpu", attn_backend="torch")
    prompt = [5, 6, 7, 8, 9, 10]
    runner.run(build_layout([Chunk(prompt, 0, [0, 1])], 4, "cpu"))  # KV of positions 0..5
    layout = build_layout([Chunk([11, 12], 6, [0, 1], num_logits=2),
                           Chunk([20, 21, 22], 0, [2], num_logits=1)], 4, "cpu")
    got = runner.run(layout)
    meta = AttentionMetadata.build([2, 3], [8, 3], [[0, 1], [2]], 4)
    want, _ = runner.forward(torch.tensor([11, 12, 20, 21, 22]),
                             torch.tensor([6, 7, 0, 1, 2]), meta, torch.tensor([0, 1, 4]))
    assert got.shape == (3, BASE["vocab_size"])
    assert torch.equal(got, want)
