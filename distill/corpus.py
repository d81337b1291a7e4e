"""The large distillation corpus: every train prompt the templates allow, as conversations.

``distill/prompts.json`` samples 120 train prompts per category from ``build_prompts``'
templates and components; the combinations allow about 8,000. This module takes all of them
(capped per category so that stories, with the most combinations, do not dominate) and turns
each into a conversation of 1..``max_turns`` user turns: the first turn is the prompt, later
turns are follow-ups ("Make it shorter.", "Now add error handling.") asked after the target's
own previous answer, which ``specserve.distill.data`` feeds back as the assistant turn. So the
teacher data also holds what the target says deep in a chat, with its own earlier words in context.

Split rule (as in ``build_prompts``): train conversations use only train templates, train
components and train follow-ups (the last 10% of every follow-up list is held out). The held-out
conversations are exactly the held-out prompts of ``prompts.json`` (same ids, so evaluations
line up), continued with held-out follow-ups. ``check_corpus`` verifies that nothing held out
reaches a train conversation.

Everything is deterministic (seeded ``random.Random``) and built in well under a second, so the
corpus is not stored: any prefix of ``build_train_corpus()`` mixes every category, and a
shorter run's shards are the first shards of a longer one.
"""

from __future__ import annotations

import hashlib
import random

from specserve.distill import build_prompts as bp
from specserve.distill.data import Conversation, Prompt

SEED = 0
PER_CATEGORY = 800  # most train conversations taken from one category

# Follow-ups any answer can take. The last 10% (by the split rule) are held out.
GENERIC_FOLLOWUPS = [
    "Thanks! Can you make that shorter?",
    "Can you explain that in simpler words?",
    "Could you give me a concrete example?",
    "Can you summarize your answer in one sentence?",
    "Please turn that into a bulleted list.",
    "What is the most important point there, and why?",
    "Can you go into more detail on the first point?",
    "Is there anything you left out?",
    "Can you say that again in a more formal tone?",
    "Make it friendlier, please.",
    "Great. What should I do next?",
    "Can you double-check that and correct any mistakes?",
    "Could you expand on that a little?",
    "How would you explain this to a child?",
    "Can you put the key points in a short table?",
    "What are the common mistakes people make with this?",
    "Rewrite your answer for a busy reader.",
    "Can you add a short conclusion?",
    "Give me a one-line version I can remember.",
    "Which part of your answer is the least certain?",
]

CATEGORY_FOLLOWUPS: dict[str, list[str]] = {
    "chat": [
        "Interesting! Tell me more.", "Why is that?", "How do we know that?",
        "What is a good book or resource to learn more?", "What do most people get wrong here?",
        "How has that changed over time?", "Can you give me a fun fact about it?",
        "How does that affect everyday life?", "What questions are still open about it?",
        "What would you tell a skeptical friend?",
    ],
    "instruction": [
        "Can you give me three more tips?", "Which of these should I start with?",
        "What would you recommend for someone on a tight budget?",
        "Can you make it a step-by-step plan for one week?", "What if I only have ten minutes?",
        "Put that in a table with pros and cons.", "Now give me a short checklist.",
        "How would this differ for a beginner and an expert?",
        "Which tip has the biggest effect, and why?", "Explain the analogy again, differently.",
    ],
    "code_write": [
        "Can you add error handling?", "Now write a few unit tests for it.",
        "Can you add type hints and a docstring?", "Make it faster for very large inputs.",
        "Explain how it works line by line.", "Rewrite it without using any libraries.",
        "What edge cases does it miss?", "Can you write it as a one-liner, if that is readable?",
        "Rewrite it in another language you know well.", "How would you test it by hand?",
    ],
    "code_read": [
        "Can you rewrite it to be more readable?", "How would you test this code?",
        "What would happen with an empty input?", "Can you add comments to it?",
        "Is there a faster way to do the same thing?", "Show me the fixed version in full.",
        "What is its time complexity?", "Explain the bug to a beginner.",
        "Could this code fail in production? How?", "Rename the variables to clearer names.",
    ],
    "rewrite": [
        "Now make it even shorter.", "Can you make it more formal?",
        "Give me a version for social media.", "Keep the original tone but fix the grammar only.",
        "Make it sound more enthusiastic.", "Now write it as a short email.",
        "Turn it into three bullet points.", "What did you change, and why?",
        "Write a catchy title for it.", "Rewrite it for a ten-year-old.",
    ],
    "summarize": [
        "Now in exactly three bullet points.", "What is one thing the text does not explain?",
        "Write a title for the passage.", "What would be a good follow-up question?",
        "Summarize it for a child.", "Which sentence in the text is the most important?",
        "Give me the summary as a tweet.", "What is the tone of the original text?",
        "List the facts in the text that could be checked.", "Is the text biased in any way?",
    ],
    "list": [
        "Can you give me five more?", "Which one would you pick first, and why?",
        "Sort them from easiest to hardest.", "Add one sentence about each.",
        "Which of these are the cheapest?", "Make the list fit a family with young kids.",
        "Group them into categories.", "Which one is the most surprising?",
        "Turn the list into a short paragraph.", "Remove the weakest two and explain why.",
    ],
    "story": [
        "Continue the story.", "Can you give it a different ending?",
        "Tell the same story from another character's point of view.",
        "Make it funnier.", "Give the story a title and a one-line summary.",
        "Add a dialogue scene in the middle.", "Make it suitable for a five-year-old.",
        "Write a short sequel.", "What is the moral of the story?",
        "Rewrite the opening so it hooks the reader faster.",
    ],
    "poem": [
        "Can you make it rhyme?", "Now write a haiku version.", "Add another stanza.",
        "Make it more cheerful.", "Explain the imagery you used.", "Give the poem a title.",
        "Rewrite it as a short prose paragraph.", "Make it shorter and simpler.",
        "Write a second poem on the same subject in a different mood.",
        "Which line is the strongest, and why?",
    ],
    "email": [
        "Make it shorter.", "Can you make it more polite?", "Add a clear subject line.",
        "Now write the reply I might get.", "Make it a bit firmer.",
        "Turn it into a text message.", "Can you add a friendly opening line?",
        "Write a follow-up for if I get no answer in a week.",
        "Make it sound less formal.", "What tone does the email have, and is it right?",
    ],
    "definition": [
        "Can you give me another example?", "How is it different from a related idea?",
        "Use it in a sentence.", "Where does the term come from?",
        "Explain it to a university student.", "What is a common misunderstanding about it?",
        "Why does it matter in real life?", "Give me a short quiz question about it.",
        "What is the opposite idea?", "Explain it with an analogy.",
    ],
    "howto": [
        "What tools do I need for that?", "What are the most common mistakes?",
        "How long will it take?", "What if I don't have all the tools?",
        "Can you make the steps shorter?", "What safety precautions should I take?",
        "How do I know I did it right?", "What should I do if step two fails?",
        "Turn the steps into a checklist.", "Explain step three in more detail.",
    ],
    "math": [
        "Can you check your answer another way?", "What if all the numbers were doubled?",
        "Explain it step by step for a child.", "Write the calculation as one equation.",
        "Make up a similar problem for me to solve.", "What is the answer as a fraction?",
        "Where could someone make a mistake in this problem?",
        "How would you estimate the answer quickly in your head?",
        "Solve the similar problem you would give a student next.",
        "Draw the problem as a simple table.",
    ],
}


def followups(category: str, split: str) -> list[str]:
    """The follow-up turns a conversation of ``category`` may take in ``split``."""
    generic = bp.split(GENERIC_FOLLOWUPS)
    specific = bp.split(CATEGORY_FOLLOWUPS[category])
    pick = 0 if split == "train" else 1
    return generic[pick] + specific[pick]


def _rng(conv_id: str) -> random.Random:
    """A per-conversation generator, so a conversation's turns do not depend on its neighbours."""
    digest = hashlib.sha256(f"{SEED}:{conv_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def continue_conversation(conv_id: str, category: str, split: str, first: str,
                          max_turns: int) -> tuple[str, ...]:
    """``first`` plus 0..max_turns-1 follow-ups (uniform count, no repeats)."""
    rng = _rng(conv_id)
    extra = rng.randint(0, max(0, max_turns - 1))
    return (first, *rng.sample(followups(category, split), extra))


def train_prompts(per_category: int = PER_CATEGORY) -> list[tuple[str, str]]:
    """(category, prompt): every filling of the train templates with train components, at most
    ``per_category`` per category, in a seeded order that interleaves the categories."""
    rng = random.Random(SEED)
    train_slots, _ = bp.split_slots()
    per_cat: list[list[tuple[str, str]]] = []
    for category, templates in bp.TEMPLATES.items():
        train_templates, _ = bp.split(templates)
        pool: list[str] = []
        for template in train_templates:
            pool.extend(bp.expand(template, train_slots, rng))
        pool = list(dict.fromkeys(pool))
        rng.shuffle(pool)
        per_cat.append([(category, p) for p in pool[:per_category]])
    # Round-robin over categories, so every prefix of the corpus mixes all of them.
    out: list[tuple[str, str]] = []
    for i in range(max(len(c) for c in per_cat)):
        out.extend(c[i] for c in per_cat if i < len(c))
    return out


def build_train_corpus(max_turns: int = 2, per_category: int = PER_CATEGORY) -> list[Conversation]:
    """The train conversations (ids ``corpus-<category>-<n>``)."""
    counts: dict[str, int] = {}
    convs = []
    for category, prompt in train_prompts(per_category):
        counts[category] = counts.get(category, 0) + 1
        conv_id = f"corpus-{category}-{counts[category]:05d}"
        turns = continue_conversation(conv_id, category, "train", prompt, max_turns)
        convs.append(Conversation(conv_id, category, "train", turns))
    return convs


def heldout_conversations(heldout: list[Prompt], max_turns: int = 2) -> list[Conversation]:
    """The held-out prompts of a prompt set (same ids), continued with held-out follow-ups."""
    return [
        Conversation(p.id, p.category, "heldout",
                     continue_conversation(p.id, p.category, "heldout", p.prompt, max_turns))
        for p in heldout
    ]


def check_corpus(train: list[Conversation], heldout: list[Conversation]) -> None:
    """Raises AssertionError if a held-out prompt, component or follow-up reaches train."""
    _, heldout_slots = bp.split_slots()
    records = [{"split": "train", "prompt": "\n".join(c.turns)} for c in train]
    bp.check_no_leakage(records, heldout_slots)
    train_turns = {t for c in train for t in c.turns}
    for conv in heldout:
        for turn in conv.turns:
            if turn in train_turns:
                raise AssertionError(f"held-out turn of {conv.id} is a train turn: {turn[:60]!r}")
