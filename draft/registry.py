"""Proposers by name. The engine's speculator builds every proposer it can from this table, so a
new method (EAGLE, Medusa, ...) is one ``register`` call beside its class, never an edit of the
engine or the speculator. Factories import their module lazily: a proposer that needs a GPU
library never breaks a CPU import.

Besides the registered names, a request may say ``off`` (plain decoding) or ``auto`` (the
speculator picks a registered proposer per step and sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.draft.base import Proposer

OFF, AUTO = "off", "auto"


@dataclass
class ProposerContext:
    """What a factory may build from: settings and, when one is loaded, the draft model."""

    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    suffix: Any = None  # specserve.draft.suffix.SuffixOptions
    draft_runner: Any = None  # target.model_runner.ModelRunner of the draft model, or None
    eagle_runner: Any = None  # specserve.draft.eagle_head.EagleRunner of an EAGLE head, or None
    block_size: int = 16
    seed: int = 0
    # logits [N, V], opaque per-row params -> q [N, V] (the engine's sampling processing)
    probs_fn: Callable[[Any, list[Any]], Any] | None = None


@dataclass
class ProposerSpec:
    name: str
    factory: Callable[[ProposerContext], Proposer]
    needs_draft_model: bool = False
    needs_eagle_head: bool = False
    help: str = ""


class UnknownProposerError(ValueError):
    def __init__(self, name: str, known: list[str]) -> None:
        self.name, self.known = name, known
        super().__init__(f"unknown speculative method {name!r}; known: {', '.join(known)}")


@dataclass
class ProposerRegistry:
    specs: dict[str, ProposerSpec] = field(default_factory=dict)

    def register(self, spec: ProposerSpec) -> None:
        if spec.name in (OFF, AUTO) or spec.name in self.specs:
            raise ValueError(f"proposer name {spec.name!r} is taken")
        self.specs[spec.name] = spec

    def names(self) -> list[str]:
        return list(self.specs)

    def methods(self) -> list[str]:
        """Every value a request or the CLI may give as the speculative method."""
        return [*self.specs, AUTO, OFF]

    def get(self, name: str) -> ProposerSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise UnknownProposerError(name, self.methods())
        return spec

    def check_method(self, name: str) -> str:
        if name not in (OFF, AUTO):
            self.get(name)
        return name

    def build_available(self, ctx: ProposerContext) -> dict[str, Proposer]:
        """Every proposer this context can run (the draft-model ones only with a draft, the
        EAGLE one only with a head)."""
        return {
            name: spec.factory(ctx)
            for name, spec in self.specs.items()
            if (not spec.needs_draft_model or ctx.draft_runner is not None)
            and (not spec.needs_eagle_head or ctx.eagle_runner is not None)
        }


def _ngram(ctx: ProposerContext) -> Proposer:
    from specserve.draft.ngram import NgramProposer

    return NgramProposer(ctx.prompt_lookup_min, ctx.prompt_lookup_max)


def _suffix(ctx: ProposerContext) -> Proposer:
    from specserve.draft.suffix import SuffixOptions, SuffixProposer

    return SuffixProposer(ctx.suffix or SuffixOptions())


def _draft(ctx: ProposerContext) -> Proposer:
    from specserve.draft.model_proposer import DraftModelProposer

    return DraftModelProposer(ctx.draft_runner, ctx.block_size, ctx.probs_fn, ctx.seed)


def _eagle(ctx: ProposerContext) -> Proposer:
    from specserve.draft.eagle import EagleProposer

    return EagleProposer(ctx.eagle_runner, ctx.probs_fn, ctx.seed)


def default_registry() -> ProposerRegistry:
    reg = ProposerRegistry()
    reg.register(ProposerSpec("draft", _draft, needs_draft_model=True,
                              help="a small LM with the target's tokenizer"))
    reg.register(ProposerSpec("eagle", _eagle, needs_eagle_head=True,
                              help="a one-layer head on the target's hidden states "
                                   "(--draft-model DIR from `specserve distill --method eagle`)"))
    reg.register(ProposerSpec("ngram", _ngram, help="prompt lookup in the request's own text"))
    reg.register(ProposerSpec("suffix", _suffix,
                              help="suffix decoding over the request and earlier outputs"))
    return reg


REGISTRY = default_registry()
