"""Build the prompt set used to distill the draft model from the target model.

Every prompt is the text of one user chat message (the chat template is applied later). Prompts
are composed from hand-written component lists (topics, characters, templates, ... in
``prompt_parts.py``; passages and code snippets in ``prompt_texts.py``) and written to
``distill/prompts.json`` as a list of ``{"id", "category", "split", "prompt"}`` objects.

Split rule (no leakage): the last 10% (at least one item) of EVERY component list, templates
included, is reserved for the held-out split. Train prompts use only train templates and train
components; held-out prompts use only held-out components (with any template). So a held-out
prompt never shares a topic, passage, code snippet, character, name, ... with a train prompt,
and some templates are never seen in training. ``check_no_leakage`` verifies this.

The output is deterministic (the only randomness is ``random.Random(0)``). Regenerate with::

    python distill/build_prompts.py
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter, defaultdict
from itertools import product
from pathlib import Path
from typing import Any, TypeVar

from specserve.distill.prompt_parts import (
    BASH_TASKS,
    CODE_TASKS,
    COMPARE_PAIRS,
    COUNTS,
    DEFINITION_TERMS,
    HOWTO_TASKS,
    LANGS,
    LIST_SUBJECTS,
    MAIL_TASKS,
    MATH_NAMES,
    POEM_FORMS,
    POEM_SUBJECTS,
    SQL_TASKS,
    STORY_CHARACTERS,
    STORY_SETTINGS,
    TEMPLATES,
    TIP_SUBJECTS,
    TONES,
    TOPICS,
    MailTask,
    Pair,
)
from specserve.distill.prompt_texts import PASSAGES, SNIPPETS, Snippet

OUT_PATH = Path(__file__).resolve().parent / "prompts.json"
HELDOUT_FRACTION = 0.1
TRAIN_PER_CATEGORY = 120
HELDOUT_PER_CATEGORY = 12
SEED = 0

T = TypeVar("T")


def split(items: list[T]) -> tuple[list[T], list[T]]:
    """The split rule: the last 10% (at least one) of a list is held out."""
    k = max(1, round(len(items) * HELDOUT_FRACTION))
    return items[:-k], items[-k:]


# ---------------------------------------------------------------------------------------------
# Slots: placeholder name -> component list. Subject lists are split; shared lists are not.
# ---------------------------------------------------------------------------------------------

def subject_slots() -> dict[str, list[Any]]:
    """Every placeholder whose values carry a subject (and so must be split)."""
    topics = [t for domain in TOPICS.values() for t in domain]
    return {
        "topic": topics,
        "tip": TIP_SUBJECTS,
        "pair": COMPARE_PAIRS,
        "task": CODE_TASKS,
        "sql_task": SQL_TASKS,
        "bash_task": BASH_TASKS,
        "snippet": SNIPPETS,
        "passage": PASSAGES,
        "things": LIST_SUBJECTS,
        "character": STORY_CHARACTERS,
        "setting": STORY_SETTINGS,
        "subject": POEM_SUBJECTS,
        "mail": MAIL_TASKS,
        "term": DEFINITION_TERMS,
        "howto": HOWTO_TASKS,
        "name": MATH_NAMES,
    }


SHARED_SLOTS: dict[str, list[str]] = {
    "lang": LANGS, "tone": TONES, "form": POEM_FORMS, "n": COUNTS,
}


def split_slots() -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Apply the split rule to each subject list (topics: per domain, so every domain is held
    out a little). ``bug`` is derived from the already-split snippets."""
    train: dict[str, list[Any]] = {}
    heldout: dict[str, list[Any]] = {}
    for key, items in subject_slots().items():
        if key == "topic":
            parts = [split(domain) for domain in TOPICS.values()]
            train[key] = [t for tr, _ in parts for t in tr]
            heldout[key] = [t for _, ho in parts for t in ho]
        else:
            train[key], heldout[key] = split(items)
    for slots in (train, heldout):
        slots["bug"] = [s for s in slots["snippet"] if s.buggy]
        slots.update(SHARED_SLOTS)
    return train, heldout


def placeholders(template: str) -> list[str]:
    """Base placeholder names in a template ("{pair.a}" -> "pair"), in order, without repeats."""
    names = [f for _, f, _, _ in string.Formatter().parse(template) if f]
    return list(dict.fromkeys(re.split(r"[.\[]", f)[0] for f in names))


NUMBER_SLOTS = {"a": range(3, 13), "b": range(2, 10), "c": range(2, 10)}


def expand(template: str, slots: dict[str, list[Any]], rng: random.Random) -> list[str]:
    """All fillings of one template from the given slots. Number slots ({a}, {b}, {c}) are drawn
    from `rng`, three draws per combination of the other slots."""
    names = placeholders(template)
    numeric = [n for n in names if n in NUMBER_SLOTS]
    other = [n for n in names if n not in NUMBER_SLOTS]
    out = []
    for values in product(*(slots[n] for n in other)):
        fields = dict(zip(other, values))
        for _ in range(3 if numeric else 1):
            nums = {n: rng.choice(NUMBER_SLOTS[n]) for n in numeric}
            out.append(template.format(**fields, **nums))
    return out


def sample_balanced(
    templates: list[str], slots: dict[str, list[Any]], quota: int, rng: random.Random,
    taken: set[str],
) -> list[str]:
    """Up to `quota` distinct prompts, spread evenly over templates (round-robin over
    per-template shuffled candidates). Prompts already in `taken` are skipped."""
    pools = []
    for template in templates:
        pool = list(dict.fromkeys(expand(template, slots, rng)))
        rng.shuffle(pool)
        pools.append(pool)
    chosen: list[str] = []
    while len(chosen) < quota and any(pools):
        for pool in pools:
            while pool and pool[-1] in taken:
                pool.pop()
            if pool and len(chosen) < quota:
                prompt = pool.pop()
                taken.add(prompt)
                chosen.append(prompt)
    return chosen


def component_texts(item: Any) -> list[str]:
    """The subject-bearing strings of a component, used for the leakage check."""
    if isinstance(item, Snippet):
        return [item.code, item.purpose]
    if isinstance(item, MailTask):
        return [item.about]
    if isinstance(item, Pair):
        return [item.a, item.b]
    return [item]


def check_no_leakage(records: list[dict[str, str]], heldout: dict[str, list[Any]]) -> None:
    """No held-out subject string may occur (as a whole word/phrase) in any train prompt."""
    train_text = "\n".join(r["prompt"] for r in records if r["split"] == "train")
    for key in subject_slots():
        for item in heldout[key]:
            for text in component_texts(item):
                pattern = r"(?<!\w)" + re.escape(text) + r"(?!\w)"
                if re.search(pattern, train_text, flags=re.IGNORECASE):
                    raise AssertionError(f"held-out {key} leaks into train: {text[:60]!r}")
    train_prompts = {r["prompt"] for r in records if r["split"] == "train"}
    assert not any(r["prompt"] in train_prompts for r in records if r["split"] == "heldout")


def validate_components() -> None:
    for i, passage in enumerate(PASSAGES):
        words = len(passage.split())
        assert 60 <= words <= 150, f"passage {i} has {words} words"
    assert len(set(PASSAGES)) == len(PASSAGES) >= 40
    assert len({s.code for s in SNIPPETS}) == len(SNIPPETS) >= 15
    assert any(s.buggy for s in split(SNIPPETS)[1]), "held-out snippets need a buggy one"


def build() -> list[dict[str, str]]:
    validate_components()
    rng = random.Random(SEED)
    train_slots, heldout_slots = split_slots()
    taken: set[str] = set()
    records: list[dict[str, str]] = []
    for category, templates in TEMPLATES.items():
        train_templates, _ = split(templates)
        prompts = [
            ("train", p)
            for p in sample_balanced(train_templates, train_slots, TRAIN_PER_CATEGORY, rng, taken)
        ] + [
            ("heldout", p)
            for p in sample_balanced(templates, heldout_slots, HELDOUT_PER_CATEGORY, rng, taken)
        ]
        for i, (split_name, prompt) in enumerate(prompts, start=1):
            records.append(
                {"id": f"{category}-{i:04d}", "category": category, "split": split_name,
                 "prompt": prompt}
            )
    check_no_leakage(records, heldout_slots)
    return records


def main() -> None:
    records = build()
    OUT_PATH.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    by_cat: dict[str, Counter[str]] = defaultdict(Counter)
    for r in records:
        by_cat[r["category"]][r["split"]] += 1
    print(f"{'category':<12} {'train':>6} {'heldout':>8}")
    for category, counts in by_cat.items():
        print(f"{category:<12} {counts['train']:>6} {counts['heldout']:>8}")
    splits = Counter(r["split"] for r in records)
    print(f"{'total':<12} {splits['train']:>6} {splits['heldout']:>8}  ({len(records)} prompts, "
          f"{splits['heldout'] / len(records):.1%} held out) -> {OUT_PATH}")


if __name__ == "__main__":
    main()
