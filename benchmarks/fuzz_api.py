"""A longer schemathesis run against a real `specserve serve` process (the test suite runs a
bounded quick one: tests/test_api_schema.py).

Starts the server (by default on a tiny random Llama with the built-in model's real tokenizer,
built into the output folder, so that thousands of generations stay cheap: the API is what is
fuzzed, not the model), runs the schemathesis CLI against GET /openapi.json with --max-examples
per operation, then checks that the server is alive, has nothing in flight and every KV block
back in the pool. Reports operations tested, test cases generated, failures found (grouped by
schemathesis) and errors.

Checks: all of schemathesis's, among them not_a_server_error (no 5xx), status_code_conformance
(every status documented), content_type_conformance, response_schema_conformance (every body, 4xx
included, in its documented schema: OpenAI's error shape for errors), positive_data_acceptance
(every body the document allows is answered 2xx; run as its stand-in in
benchmarks/schemathesis_hooks.py, which also accepts the two answers no schema can state: the
context window and the request's own timeout), negative_data_rejection (every body it forbids
is answered 4xx) and unsupported_method (405 with an Allow header).

    python benchmarks/fuzz_api.py [--max-examples 300] [--model PATH] [--seed 1]
                                  [--server-args "..."] [--write-results]

Exit status 0 when no failure, no error, and the server is healthy and drained afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.launched_server import LaunchedServer  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BenchError,
    md_table,
    out_dir,
    run_info,
    write_json,
    write_results_section,
)
from benchmarks.schemathesis_hooks import REPLACED_CHECK  # noqa: E402

HEADING = "## API fuzzing: schemathesis, long run (benchmarks/fuzz_api.py)"
CHECKS = "all"


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def build_tiny(path: str) -> None:
    """The server tests' model (tests/fixtures/models.py ``model_dir``, same recipe): a tiny
    random Llama with the built-in model's real tokenizer, cheap to generate with."""
    from tests.helpers.tiny_models import build_tiny_model, default_tokenizer, tiny_config

    tok = default_tokenizer()
    cfg = tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    build_tiny_model(path, cfg, tokenizer=tok)


def server_flags(args: argparse.Namespace, model: str) -> list[str]:
    tiny = [] if args.model else ["--dtype", "float32", "--block-size", "4", "--num-kv-blocks",
                                  "1024", "--max-model-len", "256"]
    return ["--model", model, "--served-model-name", "fuzzed", *tiny,
            *shlex.split(args.server_args)]


def fuzz(args: argparse.Namespace, url: str, out: Path) -> tuple[dict, float]:
    report_path = out / "schemathesis.json"
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", url + "/openapi.json",
           "--max-examples", str(args.max_examples), "--seed", str(args.seed), "--workers", "1",
           "--checks", CHECKS, "--exclude-checks", REPLACED_CHECK,  # run by its stand-in
           "--request-timeout", "300", "--max-response-time", "300", "--no-color",
           "--generation-database", "none", "--suppress-health-check", "all",
           "--report", "json", "--report-json-path", str(report_path)]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "benchmarks.schemathesis_hooks",
           "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=out, env=env)
    (out / "schemathesis.log").write_text(run.stdout + run.stderr)
    if not report_path.exists():
        raise SystemExit(f"schemathesis wrote no report (exit {run.returncode}); see "
                         f"{out}/schemathesis.log")
    return json.loads(report_path.read_text()), time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-examples", type=int, default=300,
                    help="schemathesis examples per operation and phase [default: 300]")
    ap.add_argument("--model", default=None,
                    help="--model for the server [default: a tiny random Llama, built here]")
    ap.add_argument("--server-args", default="", help="extra `specserve serve` flags")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="folder for the report and the logs")
    ap.add_argument("--write-results", action="store_true",
                    help="replace this section of benchmarks/RESULTS.md")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    out = out_dir(args.out, "fuzz_api")
    info = run_info(argv, "python benchmarks/fuzz_api.py")
    model = args.model
    if model is None:
        model = str(out / "tiny_model")
        if not (Path(model) / "config.json").exists():
            build_tiny(model)
    with LaunchedServer(server_flags(args, model), out / "server.log", args.startup_timeout,
                        root=ROOT, stop_timeout=60) as server:
        report, seconds = fuzz(args, server.url, out)
        time.sleep(1.0)  # the last case's sequences end at the engine's next step
        status, health = get(server.url + "/health")
    ops, cases = report["operations"], report["test_cases"]
    drained = (status == 200 and health["num_in_flight"] == 0
               and health["kv_blocks_free"] == health["kv_blocks_total"])
    ok = not report["failures"] and not report["errors"] and drained
    write_json(out / "summary.json", {"info": info, "seconds": seconds, "report": report,
                                      "health_after": health,
                                      "server_exit": server.proc.returncode})
    lines = md_table(
        ["operations tested", "test cases generated", "cases with failures", "unique failures",
         "errored", "minutes", "afterwards"],
        [[f"{ops['tested']} / {ops['total']}", str(cases["generated"]),
          str(cases["with_failures"]), str(cases["unique_failures"]), str(cases["errored"]),
          f"{seconds / 60:.1f}",
          f"/health {status}, {health.get('num_in_flight')} in flight, "
          f"{health.get('kv_blocks_free')}/{health.get('kv_blocks_total')} KV blocks free"]])
    for group in report["failures"]:
        lines.append(f"- failure `{group['type']}` x{group['count']}: {group['title']} "
                     f"({', '.join(group['operations'])})")
    for group in report["errors"]:
        lines.append(f"- error x{group['count']}: {group['title']}")
    print("\n".join(lines))
    if args.write_results:
        served = "a tiny random Llama (the test suite's recipe)" if args.model is None else model
        intro = (f"schemathesis, {CHECKS} checks, against every operation of "
                 f"/openapi.json, --max-examples {args.max_examples}, seed {args.seed}; server "
                 f"on {served}. Verdict: {'pass' if ok else 'FAIL'}.")
        write_results_section(HEADING, info, intro, lines)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:  # the server would not start
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
