"""What ``--draft-model`` accepts: each kind of draft is recognised from its path (an EAGLE head
folder, a GGUF file, a Hugging Face folder), and a path that is none of them is refused with a
message that names every kind and how to give it."""

from __future__ import annotations

import pytest
import torch

from specserve.core.errors import ModelLoadError
from specserve.draft.loading import (
    DRAFT_KINDS,
    DRAFT_MODEL,
    EAGLE_HEAD,
    RUNS_AS,
    detect_kind,
    how_to_give,
)
from tests.helpers.tiny_models import GGUF_VOCAB_SIZE, build_tiny_model, tiny_config


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """One draft of each kind: a Hugging Face folder, a GGUF file and an EAGLE head folder."""
    from specserve.distill.eagle_build import build_head, save_head
    from specserve.draft.eagle_head import default_target_layers
    from specserve.target.loader import load_weights

    root = tmp_path_factory.mktemp("kinds")
    build_tiny_model(root / "hf", tiny_config())
    build_tiny_model(root / "d.gguf", tiny_config(vocab_size=GGUF_VOCAB_SIZE), fmt="gguf")
    hf_config, state = load_weights(root / "hf")
    head = build_head(hf_config, state, torch.arange(0, hf_config.vocab_size, 2),
                      default_target_layers(hf_config.num_hidden_layers))
    save_head(head, hf_config, root / "head", {"target": "tiny"})
    return root


def test_each_kind_is_detected(drafts):
    assert detect_kind(str(drafts / "hf")).name == "hf_folder"
    assert detect_kind(str(drafts / "d.gguf")).name == "gguf"
    assert detect_kind(str(drafts / "head")).name == "eagle_head"
    assert {k.runs_as for k in DRAFT_KINDS} <= set(RUNS_AS)
    assert [k.name for k in DRAFT_KINDS if k.runs_as == DRAFT_MODEL] == ["gguf", "hf_folder"]
    assert [k.name for k in DRAFT_KINDS if k.runs_as == EAGLE_HEAD] == ["eagle_head"]


@pytest.mark.parametrize("make, hint", [
    (lambda p: p.mkdir(), None),  # an empty folder
    (lambda p: p.write_text("not a model"), None),  # a file that is not a GGUF
    (lambda p: (p.mkdir(), (p / "x.gguf").write_bytes(b"GGUF")), "pass the file itself"),
])
def test_a_path_that_is_no_draft_is_refused_naming_every_kind(tmp_path, make, hint):
    path = tmp_path / "thing"
    make(path)
    with pytest.raises(ModelLoadError) as err:
        detect_kind(str(path))
    message = str(err.value)
    assert f"draft {path} is none of the drafts --draft-model accepts" in message
    for kind in DRAFT_KINDS:
        assert kind.how in message
    assert (hint is None) == ("pass the file itself" not in message)


def test_how_to_give_names_every_kind_that_runs_as_it():
    assert how_to_give(DRAFT_MODEL).count("--draft-model") == 2
    assert "FILE.gguf" in how_to_give(DRAFT_MODEL)
    assert "specserve distill --method eagle" in how_to_give(EAGLE_HEAD)
