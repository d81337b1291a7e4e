"""`specserve generate` (and, as they land, serve / bench / distill).

Engine flags map one to one onto ``EngineConfig`` fields, with vLLM's names, and are generated
from its declaration (``add_engine_args``). User errors print one line (``error: ...``) and
exit 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import msgspec

from specserve.core.config import EngineConfig
from specserve.core.errors import SpecServeError
from specserve.core.settings import describe
from specserve.distill.cli import add_distill_parser, cmd_distill


# Settings whose names are known only above core/: the CLI lists them from their registries.
def _dynamic_choices() -> dict[str, list[str]]:
    from specserve.draft.registry import REGISTRY
    from specserve.kernels.registry import available_backends

    return {"speculative_method": REGISTRY.methods(), "attention_backend": available_backends()}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field, generated from its declaration: the type, the
    choices (a ``Literal``, or the registry's names), the default and the help all come from
    the one table (specserve/core/config.py), so they cannot drift from what the engine takes."""
    group = parser.add_argument_group("engine")
    dynamic = _dynamic_choices()
    for s in describe(EngineConfig):
        flag = "--" + s.flag
        help_text = s.help.replace("%", "%%")
        if "(default" not in help_text:
            help_text += f" [default: {s.default}]"
        if s.kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=s.default,
                               help=help_text)
            continue
        choices = s.choices if s.choices is not None else dynamic.get(s.name)
        group.add_argument(flag, type=s.kind, default=s.default, choices=choices,
                           help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{s.name: getattr(args, s.name) for s in describe(EngineConfig)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve", description="Speculative-decoding LLM engine and server."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion offline and print it")
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts run batched)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("-v", "--verbose", action="store_true", help="log engine set-up")
    add_engine_args(gen)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_distill_parser(sub)
    sub.add_parser("build", help="compile the C++ kernels and the suffix trie for this machine "
                                 "now (otherwise the first start does); `make install` runs it")
    return parser


def add_serve_parser(sub) -> None:
    from specserve.server.server_config import ServerConfig

    d = ServerConfig()
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP/SSE + WebSocket API")
    group = srv.add_argument_group("server")
    group.add_argument("--host", default=d.host, help=f"address to listen on [default: {d.host}]")
    group.add_argument("--port", type=int, default=d.port, help=f"TCP port [default: {d.port}]")
    group.add_argument("--api-key", action="append", default=None,
                       help="require `Authorization: Bearer KEY` on /v1/* and /ws; repeat it "
                            "for several keys, each its own tenant (suffix decoding never "
                            "drafts from another key's outputs) [default: None, no auth]")
    group.add_argument("--max-queue-len", type=int, default=d.max_queue_len,
                       help="sequences that may wait beyond --max-num-seqs before requests get "
                            f"429 [default: {d.max_queue_len}]")
    group.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                       help=f"larger request bodies get 413 [default: {d.max_body_bytes}]")
    group.add_argument("--served-model-name", default=d.served_model_name,
                       help="model name in the API [default: the --model value, or "
                            "SmolLM2-135M-Instruct for the built-in model]")
    group.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                       help="seconds SIGTERM waits for aborted streams to flush "
                            f"[default: {d.shutdown_timeout}]")
    group.add_argument("--request-timeout", type=float, default=d.request_timeout,
                       help="seconds from arrival after which a request is aborted "
                            "(finish_reason abort, a 408 or an error event); a request's own "
                            "`timeout` field wins [default: None, no deadline]")
    group.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=d.warmup,
                       help="run real short requests before /health reports ready "
                            f"[default: {d.warmup}]")
    srv.add_argument("-v", "--verbose", action="store_true", help="log engine set-up")
    add_scale_args(srv)
    add_engine_args(srv)


def add_scale_args(srv: argparse.ArgumentParser) -> None:
    """Replicas on Ray Serve (the `ray` extra); see specserve/scale/ray_serve.py."""
    from specserve.scale.scale_config import ROUTERS, ScaleConfig

    d = ScaleConfig()
    group = srv.add_argument_group("scale-out (Ray Serve; needs `pip install specserve[ray]`)")
    group.add_argument("--replicas", type=int, default=d.replicas,
                       help="engine replicas, each with its own KV / prefix / suffix cache; "
                            "above 1 they run on Ray Serve behind one ingress on --host/--port "
                            f"[default: {d.replicas}]")
    group.add_argument("--ray-address", default=d.ray_address,
                       help="join this Ray cluster (e.g. ray://head:10001 or auto) [default: "
                            "start a local one]; implies Ray Serve even with --replicas 1")
    group.add_argument("--replica-cpus", type=float, default=d.replica_cpus,
                       help="CPUs Ray reserves per replica; also its torch threads unless "
                            f"--num-threads is set [default: {d.replica_cpus}]")
    group.add_argument("--replica-gpus", type=float, default=d.replica_gpus,
                       help=f"GPUs per replica (1 = a whole GPU each) [default: {d.replica_gpus}]")
    group.add_argument("--request-router", default=d.request_router, choices=ROUTERS,
                       help="prefix: requests sharing their first KV blocks go to the same "
                            "replica (its prefix cache holds them); pow2: Ray's default "
                            f"power-of-two-choices [default: {d.request_router}]")
    group.add_argument("--prefix-routing-blocks", type=int, default=d.prefix_routing_blocks,
                       help="leading KV blocks (of --block-size tokens) hashed for affinity "
                            f"[default: {d.prefix_routing_blocks}]")
    group.add_argument("--prefix-routing-imbalance", type=int,
                       default=d.prefix_routing_imbalance,
                       help="in-flight requests the preferred replica may have beyond the "
                            "least-loaded one before a request goes to the least-loaded one "
                            f"[default: {d.prefix_routing_imbalance}]")


def scale_config_from_args(args: argparse.Namespace):
    from specserve.scale.scale_config import ScaleConfig

    return ScaleConfig(
        replicas=args.replicas, ray_address=args.ray_address, replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus, request_router=args.request_router,
        prefix_routing_blocks=args.prefix_routing_blocks,
        prefix_routing_imbalance=args.prefix_routing_imbalance)


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.core.sampling_params import SamplingParams
    from specserve.engine.llm_engine import LLMEngine

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.request_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(engine_config_from_args(args))
    load_s = time.perf_counter() - t0
    prompts: list[str] = args.prompt
    if args.chat:
        prompts = [engine.render_chat([{"role": "user", "content": p}]) for p in prompts]
    t1 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t1
    for i, out in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- [{i}] ---")
        print(out.text)
    n_out = sum(o.num_output_tokens for o in outputs)
    ttft = outputs[0].timings.ttft_ms or 0.0
    drafted = sum(o.timings.num_drafted for o in outputs)
    accepted = sum(o.timings.num_accepted for o in outputs)
    spec = f"; drafts accepted {accepted}/{drafted}" if drafted else ""
    print(
        f"[{n_out} tokens in {elapsed:.2f} s: {n_out / elapsed:.1f} tok/s; "
        f"prompt {sum(o.num_prompt_tokens for o in outputs)} tokens; TTFT {ttft:.0f} ms; "
        f"load {load_s:.1f} s; finish {outputs[0].finish_reason}{spec}]",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.llm_engine import LLMEngine
    from specserve.server.app import configure_logging, run_server
    from specserve.server.server_config import ServerConfig

    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key, max_queue_len=args.max_queue_len,
        max_body_bytes=args.max_body_bytes, served_model_name=args.served_model_name,
        shutdown_timeout=args.shutdown_timeout, warmup=args.warmup,
        request_timeout=args.request_timeout,
    )
    engine_config = engine_config_from_args(args)
    scale = scale_config_from_args(args)
    if scale.uses_ray:
        try:
            from specserve.scale import ray_serve
        except ImportError as exc:
            raise SpecServeError(f"--replicas / --ray-address need Ray Serve ({exc}): "
                                 "pip install 'specserve[ray]'") from exc
        configure_logging()
        return ray_serve.run(engine_config, config, scale, args.model)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # Windows: plain asyncio
        pass
    configure_logging()
    engine = LLMEngine(engine_config)
    aengine = AsyncEngine(engine, config.max_queue_len, config.warmup)
    run_server(aengine, config, args.model)
    # A dead engine thread ends the process non-zero, so a supervisor restarts it.
    return 1 if aengine.error is not None else 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="benchmarks: offline A/B, online load sweep, latency attribution",
        description="Runs `python -m benchmarks MODE [flags]` from this source checkout. Modes: "
                    "offline (A/B against transformers in one process), sweep (online load "
                    "sweep against a live server), attribution (one request, phase by phase, "
                    "and a Chrome trace). `specserve bench MODE --help` lists a mode's flags.",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="MODE [flags]",
                       help="offline | sweep | attribution, then that mode's flags")


def cmd_bench(args: argparse.Namespace) -> int:
    """Forwards to ``python -m benchmarks``: benchmarks/ belongs to the source tree, not to the
    installed package, so it runs with the checkout on PYTHONPATH."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__main__.py").is_file():
        raise SpecServeError("specserve bench needs a source checkout (benchmarks/ beside "
                             "specserve/): run it from a clone of the repository")
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "benchmarks", *args.bench_args]
    return subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path}).returncode


def cmd_build(args: argparse.Namespace) -> int:
    """Both extensions compiled side by side; exit 1 (with the reason logged) if one cannot be
    built here, as the engine then falls back to torch kernels or the Python trie."""
    from specserve.engine.prebuild import build_all

    t0 = time.perf_counter()
    usable = build_all()
    for name, ok in usable.items():
        print(f"{name}: {'ready' if ok else 'unavailable (see the warning above)'}")
    print(f"built in {time.perf_counter() - t0:.1f}s")
    return 0 if all(usable.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "build":
            return cmd_build(args)
        if args.command == "distill":
            return cmd_distill(args)
    except (SpecServeError, msgspec.ValidationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
