"""Prefix-cache hit rate and TTFT on Ray Serve replicas: prefix-aware routing vs Ray's default
power-of-two-choices, against one replica as the reference.

Workload ("shared system prompts"): P distinct system prompts (an assistant profile each, ~8 KV
blocks, distinct from their first token) times Q user questions, shuffled with a fixed seed and
sent as streaming completions by C concurrent clients. Every request after the first of its
system prompt could be served from a prefix cache: one replica reaches that bound; replicas
that each see every prompt pay its prefill once per replica (more when their KV pool is too
small to keep them all), which is what affinity avoids.

Hit rate = prefix-cache hit tokens / prompt tokens looked up, summed over the replicas (each
replica's own counters, GET /replicas), for the workload only (deltas around it). TTFT is
client-side: request sent to first streamed text.

    python benchmarks/ray_prefix_routing.py [--prompts 16] [--per-prompt 6] [--concurrency 4]
        [--model PATH] [--num-kv-blocks 256] [--write]

One local Ray cluster (small object store, no dashboard); each configuration is deployed,
measured and deleted in turn, 1 CPU per replica.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.launched_server import free_port  # noqa: E402
from benchmarks.stats import percentile  # noqa: E402

TOPICS = ["billing", "travel", "cooking", "gardening", "astronomy", "chess", "plumbing",
          "poetry", "tax law", "cycling", "photography", "beekeeping", "sailing", "pottery",
          "mountaineering", "jazz", "woodworking", "genealogy", "aquariums", "calligraphy"]
QUESTIONS = ["How do I get started?", "What is the most common mistake?",
             "Which tools do I need first?", "How long does it take to learn?",
             "What does it cost per month?", "Can you give me one safety tip?",
             "What should I read next?", "How do I measure progress?"]


def system_prompt(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (f"Profile {i}: you are the {topic} assistant of shop number {100 + i}. "
            f"Answer questions about {topic} only, in at most three short sentences, in plain "
            f"words, without lists. If a question is not about {topic}, say so politely and "
            f"suggest a {topic} question instead. Never invent prices, dates or names; when "
            f"unsure, say that you are unsure. Keep a friendly, calm tone and address the "
            f"customer as you. The shop opens at nine and closes at six, Monday to Saturday.\n")


@dataclass
class Outcome:
    ttft_ms: float | None
    ok: bool


def _post_stream(url: str, body: dict) -> Outcome:
    req = urllib.request.Request(url + "/v1/completions", headers={"Content-Type":
                                 "application/json"}, data=json.dumps(body).encode())
    t0 = time.perf_counter()
    ttft = None
    ok = False
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                return Outcome(ttft, False)
            if ttft is None and event["choices"] and event["choices"][0]["text"]:
                ttft = (time.perf_counter() - t0) * 1e3
            if event["choices"] and event["choices"][0]["finish_reason"]:
                ok = True
    return Outcome(ttft, ok)


def _replicas(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(url + "/replicas", timeout=60) as resp:
        return {r["replica"]: r["stats"] for r in json.loads(resp.read())}


def run_config(engine_config, server_config, scale, bodies: list[dict],
               concurrency: int) -> dict:
    from ray import serve

    from specserve.scale import ray_serve
    serve.run(ray_serve.build_app(engine_config, server_config, scale), name=ray_serve.APP_NAME,
              route_prefix="/")
    url = f"http://127.0.0.1:{server_config.port}"
    before = _replicas(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda b: _post_stream(url, b), bodies))
    wall = time.perf_counter() - t0
    after = _replicas(url)
    serve.delete(ray_serve.APP_NAME)
    hits = sum(after[r]["prefix_hit_tokens"] - before[r]["prefix_hit_tokens"] for r in after)
    queries = sum(after[r]["prefix_query_tokens"] - before[r]["prefix_query_tokens"]
                  for r in after)
    per_replica = sorted(after[r]["prefix_query_tokens"] - before[r]["prefix_query_tokens"]
                         for r in after)
    ttfts = [o.ttft_ms for o in outcomes if o.ttft_ms is not None]
    return {"replicas": scale.replicas, "router": scale.request_router,
            "hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits,
            "query_tokens": queries, "per_replica_query_tokens": per_replica,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "ok": sum(o.ok for o in outcomes), "n": len(outcomes), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model (default: the built-in one)")
    ap.add_argument("--prompts", type=int, default=16, help="distinct system prompts (P)")
    ap.add_argument("--per-prompt", type=int, default=6, help="questions per system prompt (Q)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=256,
                    help="KV blocks per replica (256 x 16 tokens holds every system prompt of "
                         "the default workload; the engine's 2 GiB default takes minutes to "
                         "allocate on a busy 2-core machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = ap.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()  # the code that runs
    import ray

    from specserve.core.config import EngineConfig
    from specserve.scale import ray_serve
    from specserve.scale.scale_config import ScaleConfig
    from specserve.server.server_config import ServerConfig

    bodies = [{"prompt": system_prompt(p) + "Question: " + QUESTIONS[q % len(QUESTIONS)]
               + "\nAnswer:", "max_tokens": args.max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True}
              for p in range(args.prompts) for q in range(args.per_prompt)]
    random.Random(args.seed).shuffle(bodies)
    engine = EngineConfig(model=args.model, speculative_method="off", draft_model="none",
                          num_kv_blocks=args.num_kv_blocks, max_model_len=1024)
    port = free_port()
    server = ServerConfig(port=port)
    ray.init(num_cpus=2, object_store_memory=100 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False, runtime_env=ray_serve.source_runtime_env())
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    for replicas, router in ((1, "prefix"), (2, "pow2"), (2, "prefix")):
        row = run_config(engine, server, ScaleConfig(replicas=replicas, request_router=router),
                         bodies, args.concurrency)
        print(json.dumps(row), flush=True)
        rows.append(row)
    serve.shutdown()
    ray.shutdown()
    table = render(rows, args, commit)
    print(table)
    if args.write:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
            f.write("\n" + table)


def render(rows: list[dict], args: argparse.Namespace, commit: str) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith("Model name")), "unknown")
    single = rows[0]["hit_rate"]
    cmd = " ".join(["python", "benchmarks/ray_prefix_routing.py", *sys.argv[1:]])
    lines = [
        "## Ray Serve replicas: prefix-aware routing vs power-of-two-choices",
        "",
        f"Workload: {args.prompts} system prompts x {args.per_prompt} questions "
        f"({args.prompts * args.per_prompt} streaming requests, shuffled, seed {args.seed}), "
        f"{args.concurrency} concurrent clients, {args.max_tokens} new tokens each, model "
        f"{args.model or 'built-in SmolLM2-135M-Instruct'}, speculation off, 1 CPU per replica "
        f"on a local Ray cluster. Machine: {cpu}, 2 cores, shared with other jobs while it "
        f"ran, so TTFT is noisy; the hit rates are the point. Commit {commit}.",
        "",
        f"Command: `{cmd}`",
        "",
        "| replicas | router | prefix-cache hit rate | vs 1 replica | prompt tokens per replica "
        "| TTFT p50 ms | TTFT p99 ms | completed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['replicas']} | {r['router'] if r['replicas'] > 1 else '(one replica)'} | "
            f"{r['hit_rate'] * 100:.1f}% | "
            f"{(r['hit_rate'] - single) * 100:+.1f} pts | "
            f"{' / '.join(str(q) for q in r['per_replica_query_tokens'])} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['ok']}/{r['n']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
