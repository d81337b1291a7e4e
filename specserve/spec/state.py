"""SpecState: one sequence's speculation, owned by the speculator.

What the request asked (method, k_max, tenant) lives here for the request's life; what the
speculator worked out for the current step (the method chosen, a model-free draft made while
planning and what it says of itself, a draft model's catch-up, its KV after drafting) is
cleared when the next step is planned (``new_step``); the back-off counters carry over. The
draft's KV progress is the block manager's (specserve/core/draft_kv.py), and the lookahead slots
the scheduler reserves are on ``Sequence``: nothing else of speculation is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.spec.acceptance_model import DraftHints

OFF = "off"


@dataclass(slots=True)
class SpecState:
    method: str  # asked: a registry name, "auto" or "off"
    k_max: int  # most draft tokens per step it asked for (0: off)
    tenant: str = ""  # whose cached outputs may feed its drafts (the API key's)
    prediction: list[int] | None = None  # its predicted output's token ids, drafted first
    base_k: int = 0  # k_max of its method alone (where the prediction has nothing to draft)
    step_method: str = OFF  # the proposer chosen for the current step (auto picks per step)
    # ---- this step's (cleared by new_step) ----
    early: list[int] | None = None  # the model-free draft made while planning
    hints: tuple[str, DraftHints] | None = None  # (its method, what the draft says of itself)
    # (method, k) -> expected tokens per verify at 0..k drafts (auto prices, then the policy)
    expected: dict[tuple[str, int], tuple[float, ...]] = field(default_factory=dict)
    catch_up: bool = False  # its draft model lags past the budget: catch up, do not draft
    kv_after: int | None = None  # the draft's KV after this step's proposal
    # ---- back-off: steps left without proposing, and how often in a row it came to nothing
    idle_left: int = 0
    idle_streak: int = 0

    def new_step(self) -> None:
        self.early = self.hints = self.kv_after = None
        self.catch_up = False
        self.expected.clear()

    def back_off(self, cap: int) -> None:
        """Skip the proposers for the next 1, 2, 4, .. ``cap`` steps (doubling while the
        proposals keep coming to nothing)."""
        self.idle_left = min(1 << self.idle_streak, cap)
        self.idle_streak += 1

    def keep_proposing(self) -> None:
        self.idle_left = self.idle_streak = 0
