"""What ``--draft-model`` accepts: each kind of draft is recognised from its path (an EAGLE head
folder, a GGUF file, a Hugging Face folder), and a path that is none of them is refused with a
message that names every kind and how to give it. A draft that cannot serve the target is
refused with why and what would (another tokenizer, a head trained for another hidden size, a
GGUF of an architecture we do not run), by the engine and by ``specserve serve`` as one line,
exit status 2, no traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from specserve.core.config import EngineConfig
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
from tools import checkout

ROOT = Path(__file__).resolve().parent.parent
CLI_HANG_S = 1800  # a CLI run that has not ended by then hangs, however busy the machine


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """One draft of each kind: a Hugging Face folder, a GGUF file and an EAGLE head folder."""
    from specserve.distill.eagle_build import build_head, save_head
    from specserve.draft.eagle_head import default_target_layers
    from specserve.target.loader import load_weights

    root = tmp_path_factory.mktemp("kinds")
    build_tiny_model(root / "hf", tiny_config())  # hidden 64, 300 tokens: also the target
    build_tiny_model(root / "d.gguf", tiny_config(vocab_size=GGUF_VOCAB_SIZE), fmt="gguf")
    build_tiny_model(root / "narrow", tiny_config(hidden_size=32, intermediate_size=64))
    for target, head_dir in (("hf", "head"), ("narrow", "narrow_head")):
        hf_config, state = load_weights(root / target)
        head = build_head(hf_config, state, torch.arange(0, hf_config.vocab_size, 2),
                          default_target_layers(hf_config.num_hidden_layers))
        save_head(head, hf_config, root / head_dir, {"target": target})
    _falcon_gguf(root / "falcon.gguf")
    (root / "empty").mkdir()
    return root


def _falcon_gguf(path: Path) -> None:
    """A GGUF of an architecture we do not run."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_each_kind_is_detected(drafts):
    assert detect_kind(str(drafts / "hf")).name == "hf_folder"
    assert detect_kind(str(drafts / "d.gguf")).name == "gguf"
    assert detect_kind(str(drafts / "head")).name == "eagle3_head"  # what distill writes
    assert {k.runs_as for k in DRAFT_KINDS} <= set(RUNS_AS)
    assert [k.name for k in DRAFT_KINDS if k.runs_as == DRAFT_MODEL] == ["gguf", "hf_folder"]
    assert [k.name for k in DRAFT_KINDS if k.runs_as == EAGLE_HEAD] == ["eagle3_head", "eagle_head"]


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


# draft (beside the target drafts/hf) -> what the refusal must say
REFUSED = {
    # another vocabulary runs as a text draft, which needs both tokenizers (this target has none)
    "d.gguf": "vocabulary (260 tokens) differs from the target's (300), and the target carries "
              "no tokenizer: a draft with another vocabulary drafts text, so both models need "
              "their tokenizer",
    "narrow_head": "this target has hidden size 64, vocabulary 300: use a head trained for this "
                   "target",
    "falcon.gguf": "GGUF architecture 'falcon' is not supported; specserve serves GGUF "
                   "architectures llama",
    "empty": "is none of the drafts --draft-model accepts",
}


@pytest.mark.parametrize("draft", list(REFUSED))
def test_a_draft_that_cannot_serve_the_target_is_refused_saying_why(drafts, draft):
    from specserve.engine.llm_engine import LLMEngine

    with pytest.raises(ModelLoadError) as err:
        LLMEngine(EngineConfig(model=str(drafts / "hf"), draft_model=str(drafts / draft),
                               kv_cache_memory=16 << 20, kernel_tuning=False))
    assert REFUSED[draft] in str(err.value)
    assert str(drafts / draft) in str(err.value)  # names the draft, not only "the model"


def test_each_kind_is_built_as_what_it_runs_as(drafts):
    from specserve.engine.llm_engine import LLMEngine

    for draft, runs_as, method in (("hf", DRAFT_MODEL, "draft"), ("head", EAGLE_HEAD, "eagle")):
        engine = LLMEngine(EngineConfig(model=str(drafts / "hf"), draft_model=str(drafts / draft),
                                        kv_cache_memory=16 << 20, kernel_tuning=False))
        assert engine.config.draft.kind == runs_as
        assert engine.speculator.available(method)


@pytest.mark.e2e
@pytest.mark.parametrize("draft", list(REFUSED))
def test_serve_refuses_the_draft_in_one_line(drafts, draft):
    proc = subprocess.run(
        [*checkout.command(ROOT), "-m", "specserve", "serve", "--model", str(drafts / "hf"),
         "--draft-model", str(drafts / draft), "--kv-cache-memory", str(16 << 20),
         "--no-kernel-tuning"],
        capture_output=True, text=True, timeout=CLI_HANG_S,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert REFUSED[draft] in " ".join(proc.stderr.split()), proc.stderr
