"""python -m benchmarks offline | sweep | attribution [flags]  (also: specserve bench ...)

  offline      this engine (speculation off / ngram / draft) vs transformers generate() plain,
               assisted and prompt lookup (and llama.cpp when installed), one process, greedy
  sweep        online load sweep against a live server (started here, or --url): TTFT, TPOT,
               ITL, latency percentiles, throughput, goodput, errors; speculative vs plain
  attribution  where one request's time goes, engine phase by phase, plus a Chrome trace

Each mode prints progress and a table, writes JSON (and PNG plots) under --out, and with
--write-results replaces its section of benchmarks/RESULTS.md. Exit codes: 0 ok, 1 the run
found a failure (output mismatch, request errors), 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from benchmarks.report import BenchError


def build_parser() -> argparse.ArgumentParser:
    from benchmarks import attribution, offline, sweep

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    for name, module, help_text in (
        ("offline", offline, "A/B against transformers in one process"),
        ("sweep", sweep, "online load sweep against a live server"),
        ("attribution", attribution, "one request's time, phase by phase, and a Chrome trace"),
    ):
        p = sub.add_parser(name, help=help_text, description=module.__doc__.split("\n\n")[0])
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specserve.core.errors import SpecServeError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return args.run(args, argv)
    except (BenchError, SpecServeError, msgspec.ValidationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
