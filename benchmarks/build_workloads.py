"""Builds the repetition-heavy workloads of benchmarks/workloads/ (suffix decoding's home ground):

    agentic.json    multi-turn tool-use conversations: earlier assistant turns are JSON tool calls
                    (and code) that the last user turn asks to re-emit with small edits
    templated.json  many requests whose answers share one structure (a filled-in record)

    python benchmarks/build_workloads.py [--model PATH] [--conversations 8] [--no-generate]

Each entry is a chat (a list of {"role", "content"} messages). With generation on (the default),
every earlier assistant turn of an agentic conversation is the target's own greedy answer to the
conversation so far, so the history holds what this model really emits; ``--no-generate`` writes
the scripted tool calls instead (no model needed). The files are committed; rerun to rebuild.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

OUT = ROOT / "workloads"
TOOLS = (
    "You are an agent. Call tools by answering with one JSON object per line, exactly "
    '{"tool": NAME, "arguments": {...}}. Tools: get_weather(city, unit), '
    "search_files(pattern, path), edit_file(path, line, text), run_sql(query)."
)
CITIES = ["Paris", "Lyon", "Berlin", "Madrid", "Rome", "Oslo", "Vienna", "Prague", "Lisbon"]
CODE = [
    "def total(items):\n    s = 0\n    for x in items:\n        s += x.price * x.qty\n    return s",
    "def find_user(users, name):\n    for u in users:\n        if u.name == name:\n"
    "            return u\n    return None",
]


def scripted_call(rng: random.Random, turn: int) -> str:
    city = rng.choice(CITIES)
    calls = [
        {"tool": "get_weather", "arguments": {"city": city, "unit": "celsius"}},
        {"tool": "search_files", "arguments": {"pattern": f"*{city.lower()}*.json",
                                               "path": "/data/reports"}},
        {"tool": "run_sql", "arguments": {"query": f"SELECT name, total FROM orders WHERE "
                                                   f"city = '{city}' ORDER BY total DESC"}},
    ]
    return "\n".join(json.dumps(c) for c in calls[: 1 + turn % 3])


def agentic(rng: random.Random, n: int, answer) -> list[list[dict]]:
    convs = []
    for i in range(n):
        msgs = [{"role": "system", "content": TOOLS}]
        for turn in range(3):
            city = rng.choice(CITIES)
            msgs.append({"role": "user", "content": f"Check the weather in {city}, find its "
                                                    f"report files and its biggest orders."})
            msgs.append({"role": "assistant", "content": answer(msgs, scripted_call(rng, turn))})
            msgs.append({"role": "user", "content": "Tool results: " + json.dumps(
                {"status": "ok", "temperature": rng.randint(-5, 30), "files": 2 + turn})})
        if i % 2:
            code = rng.choice(CODE)
            msgs.append({"role": "user", "content": "Rename every variable in this function to "
                         "a longer descriptive name and return the whole function:\n\n" + code})
        else:
            msgs.append({"role": "user", "content": "Repeat all your earlier tool calls exactly, "
                         f"but with the city {rng.choice(CITIES)} instead, one JSON per line."})
        convs.append(msgs)
    return convs


def templated(rng: random.Random, n: int) -> list[list[dict]]:
    products = ["kettle", "desk lamp", "backpack", "road bike", "coffee grinder", "office chair",
                "tent", "keyboard", "blender", "monitor", "rain jacket", "frying pan"]
    out = []
    for i in range(n):
        p = products[i % len(products)]
        out.append([{"role": "user", "content": (
            f"Write the catalogue record for a {p} (price {rng.randint(10, 400)} EUR). Use "
            "exactly this format:\nName: ...\nCategory: ...\nPrice: ... EUR\nIn stock: yes/no\n"
            "Summary: one sentence.\nPros: three comma-separated items.\nCons: two items.")}])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--templated", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--no-generate", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)

    def scripted(msgs, call):
        return call

    answer = scripted
    if not args.no_generate:
        from specserve.core.config import EngineConfig
        from specserve.core.sampling_params import SamplingParams
        from specserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(EngineConfig(model=args.model, draft_model="none"))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

        def answer(msgs, call):  # the target's own greedy answer to the conversation so far
            (out,) = engine.generate([engine.render_chat(msgs)], params)
            return out.text.strip() or call

    OUT.mkdir(exist_ok=True)
    (OUT / "agentic.json").write_text(json.dumps(agentic(rng, args.conversations, answer),
                                                 indent=1) + "\n")
    (OUT / "templated.json").write_text(json.dumps(templated(rng, args.templated), indent=1)
                                        + "\n")
    print("wrote", OUT / "agentic.json", OUT / "templated.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
