"""Proposers by name. The engine's speculator builds every proposer it can from this table, so a
new method (Medusa, a grammar-aware lookup, ...) is one ``register`` call beside its class, never
an edit of the engine or the speculator: what the speculator needs to know about a method it
reads from the method's ``ProposerSpec`` (which loaded draft it runs, whether ``auto`` tries it
as its model-free candidate, whether it reads the target's hidden states, its own k_max).
Factories import their module lazily: a proposer that needs a GPU library never breaks a CPU
import.

Besides the registered names, a request may say ``off`` (plain decoding) or ``auto`` (the
speculator picks a registered proposer per step and sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.core.config import EngineConfig
from specserve.draft.base import Proposer
from specserve.draft.loading import DRAFT_MODEL, EAGLE_HEAD, RUNS_AS, TEXT_DRAFT

OFF, AUTO = "off", "auto"


@dataclass(frozen=True)
class ProposerContext:
    """What a factory may build from: the engine's settings and, when one is loaded, the draft
    (``draft_kind`` one of ``specserve.draft.loading.RUNS_AS``; ``draft`` what that kind
    runs on: a ``ModelRunner`` for a draft model, an ``EagleRunner`` for an EAGLE head)."""

    settings: EngineConfig = field(default_factory=EngineConfig)
    draft_kind: str | None = None
    draft: Any = None
    # logits [N, V], opaque per-row params -> q [N, V] (the engine's sampling processing)
    probs_fn: Callable[[Any, list[Any]], Any] | None = None


@dataclass(frozen=True)
class ProposerSpec:
    name: str
    factory: Callable[[ProposerContext], Proposer]
    # the kind of loaded draft it runs (DRAFT_MODEL, EAGLE_HEAD), None: model-free
    needs_draft: str | None = None
    # auto's model-free candidate: drafted first each step, its draft priced by what it says of
    # itself, then weighed against the model proposers (at most one spec sets it)
    auto_candidate: bool = False
    # reads the target's hidden states (an EAGLE head): the target's forward captures them, and
    # its sequences hit only prefix blocks whose draft KV is written
    needs_target_features: bool = False
    # a server whose draft is of ``needs_draft``'s kind uses this method when none is asked
    default_with_draft: bool = False
    # drafts from the request's own predicted output (``ProposalRequest.prediction``): a request
    # that sends one drafts with it first, its named method (or auto) where the prediction has
    # nothing to offer (at most one spec sets it)
    reads_prediction: bool = False
    # its k_max when a request names none (None: num_speculative_tokens)
    k_max: Callable[[EngineConfig], int] | None = None
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
        if spec.needs_draft is not None and spec.needs_draft not in RUNS_AS:
            raise ValueError(f"proposer {spec.name!r} needs an unknown draft kind "
                             f"{spec.needs_draft!r}; known: {', '.join(RUNS_AS)}")
        if spec.auto_candidate and (spec.needs_draft or self.auto_candidate() is not None):
            raise ValueError("auto has one model-free candidate")
        if spec.reads_prediction and (spec.needs_draft or self.prediction_method() is not None):
            raise ValueError("one model-free proposer reads the request's prediction")
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

    def auto_candidate(self) -> ProposerSpec | None:
        return next((s for s in self.specs.values() if s.auto_candidate), None)

    def prediction_method(self) -> str | None:
        """The proposer that drafts from a request's predicted output, if one is registered."""
        return next((n for n, s in self.specs.items() if s.reads_prediction), None)

    def for_draft(self, kind: str) -> list[str]:
        """The methods that run a draft of this kind."""
        return [n for n, s in self.specs.items() if s.needs_draft == kind]

    def default_method(self, draft_kind: str | None) -> str:
        """The method of requests that name none on a server whose draft is of ``draft_kind``
        (None: no draft), when the server names none either."""
        if draft_kind is not None:
            for name, spec in self.specs.items():
                if spec.default_with_draft and spec.needs_draft == draft_kind:
                    return name
        return AUTO

    def k_max(self, method: str, settings: EngineConfig) -> int:
        """A request's most draft tokens per step when it names none: the method's own k_max
        (auto: its model-free candidate's, since that drafts longest), else
        ``num_speculative_tokens``."""
        spec = self.auto_candidate() if method == AUTO else self.specs.get(method)
        if spec is not None and spec.k_max is not None:
            return spec.k_max(settings)
        return settings.num_speculative_tokens

    def build_available(self, ctx: ProposerContext) -> dict[str, Proposer]:
        """Every proposer this context can run (model-free ones always, the others only with a
        draft of their kind)."""
        return {
            name: spec.factory(ctx)
            for name, spec in self.specs.items()
            if spec.needs_draft is None or spec.needs_draft == ctx.draft_kind
        }


def _ngram(ctx: ProposerContext) -> Proposer:
    from specserve.draft.ngram import NgramProposer

    return NgramProposer(ctx.settings.prompt_lookup_min, ctx.settings.prompt_lookup_max)


def _suffix(ctx: ProposerContext) -> Proposer:
    from specserve.draft.suffix import SuffixOptions, SuffixProposer

    return SuffixProposer(SuffixOptions.from_config(ctx.settings))


def _draft(ctx: ProposerContext) -> Proposer:
    from specserve.draft.model_proposer import DraftModelProposer

    return DraftModelProposer(ctx.draft, ctx.settings.block_size, ctx.probs_fn, ctx.settings.seed)


def _text_draft(ctx: ProposerContext) -> Proposer:
    from specserve.draft.text_draft import TextDraftProposer

    return TextDraftProposer(ctx.draft, ctx.settings.block_size,
                             ctx.settings.cross_tokenizer_method, ctx.probs_fn, ctx.settings.seed)


def _eagle(ctx: ProposerContext) -> Proposer:
    from specserve.draft.eagle import EagleProposer

    return EagleProposer(ctx.draft, ctx.probs_fn, ctx.settings.seed)


def _prediction(ctx: ProposerContext) -> Proposer:
    from specserve.draft.prediction import PredictionProposer

    return PredictionProposer()


def default_registry() -> ProposerRegistry:
    reg = ProposerRegistry()
    reg.register(ProposerSpec("draft", _draft, needs_draft=DRAFT_MODEL,
                              help="a small LM with the target's tokenizer"))
    reg.register(ProposerSpec("text_draft", _text_draft, needs_draft=TEXT_DRAFT,
                              help="a small LM with another tokenizer: it drafts text, the "
                                   "target verifies its own tokens of it (exact)"))
    reg.register(ProposerSpec("eagle", _eagle, needs_draft=EAGLE_HEAD,
                              needs_target_features=True, default_with_draft=True,
                              help="a one-layer head on the target's hidden states "
                                   "(--draft-model DIR from `specserve distill --method eagle`)"))
    reg.register(ProposerSpec("ngram", _ngram, help="prompt lookup in the request's own text"))
    # Suffix drafts are as long as their match: they get their own k_max.
    reg.register(ProposerSpec("suffix", _suffix, auto_candidate=True,
                              k_max=lambda s: s.suffix_speculative_tokens,
                              help="suffix decoding over the request and earlier outputs"))
    # A prediction is likely right for long stretches: its drafts get their own k_max.
    reg.register(ProposerSpec("prediction", _prediction, reads_prediction=True,
                              k_max=lambda s: s.prediction_speculative_tokens,
                              help="the request's predicted output (the `prediction` field), "
                                   "aligned with what was generated so far"))
    return reg


REGISTRY = default_registry()
