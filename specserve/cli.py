"""`specserve generate` (and, as they land, serve / bench / distill).

Engine flags map one to one onto ``EngineConfig`` fields, with vLLM's names. User errors print
one line (``error: ...``) and exit 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import msgspec

from specserve.core.config import EngineConfig
from specserve.core.errors import SpecServeError
from specserve.distill.cli import add_distill_parser, cmd_distill

# field -> (help, argparse type). Order is the order --help shows.
_ENGINE_FLAGS: dict[str, tuple[str, type]] = {
    "model": ("local HF folder, .gguf file or hub id (default: built-in SmolLM2-135M-Instruct)",
              str),
    "tokenizer": ("tokenizer folder/file (default: the model's own)", str),
    "draft_model": ("draft model for speculative decoding, same tokenizer as the target, or "
                    "an EAGLE head folder (`specserve distill --method eagle`); 'none' for no "
                    "draft (default: the shipped distilled draft when the target is the "
                    "built-in model)", str),
    "speculative_method": ("draft | eagle | ngram | suffix | auto | off (auto: per step and "
                           "sequence, the proposer with the best expected goodput; default: "
                           "eagle if --draft-model is an EAGLE head, draft if a draft is "
                           "loaded, else off)", str),
    "num_speculative_tokens": ("k_max: most draft tokens verified per step (0-16)", int),
    "prompt_lookup_min": ("n-gram proposer: shortest n-gram to match", int),
    "prompt_lookup_max": ("n-gram proposer: longest n-gram to match (tried first)", int),
    "suffix_speculative_tokens": ("k_max of suffix decoding (and auto's suffix drafts): a long "
                                  "match may draft this many tokens (0-16)", int),
    "suffix_cache_tokens": ("suffix decoding: global cache bound, in output tokens over all "
                            "tenants; the oldest outputs are evicted first", int),
    "suffix_cache_scope": ("suffix decoding: request (each request's own text only) | global "
                           "(also earlier outputs of the same API key)", str),
    "suffix_max_depth": ("suffix decoding: longest substring the suffix trie counts", int),
    "suffix_spec_factor": ("suffix decoding: a match of m tokens drafts at most this x m "
                           "tokens (and at most --suffix-speculative-tokens)", float),
    "dtype": ("auto | float32 | bfloat16 | float16 (auto: bf16 on GPU/bf16 CPUs, else fp32)", str),
    "quantization": ("auto | none | int4 | int8: weight-only block quantization of the target's "
                     "projections (auto: a GGUF's own Q4_0/Q4_1/Q8_0 blocks on CPU, else none)",
                     str),
    "device": ("auto | cpu | cuda[:N]", str),
    "max_model_len": ("context window in tokens (default: model's, at most 8192)", int),
    "block_size": ("tokens per KV block", int),
    "max_num_seqs": ("most sequences in one step", int),
    "max_num_batched_tokens": ("token budget of one step (prompts longer than this are "
                               "prefilled in chunks)", int),
    "kv_cache_memory": ("bytes for the KV cache pool (default 2 GiB on CPU, 90%% of free GPU "
                        "memory)", int),
    "num_kv_blocks": ("exact number of KV blocks (overrides --kv-cache-memory)", int),
    "kv_cache_dtype": ("auto | float32 | float16 | bfloat16: the target's KV cache elements "
                       "(auto: bfloat16 for a quantized model on a CPU with AVX-512 BF16, else "
                       "the model dtype; float16 and bfloat16 halve the bytes attention reads, "
                       "C++ CPU attention of a quantized model only)", str),
    "attention_backend": ("auto | torch | sdpa | triton | flash_attn (auto: best available)", str),
    "seed": ("seed for requests that give none", int),
    "num_threads": ("torch CPU threads (default: torch's choice)", int),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    group = parser.add_argument_group("engine")
    for name, (help_text, typ) in _ENGINE_FLAGS.items():
        default = getattr(defaults, name)
        group.add_argument(
            "--" + name.replace("_", "-"), type=typ, default=default,
            help=help_text if "(default" in help_text else f"{help_text} [default: {default}]",
        )
    group.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        default=defaults.enable_prefix_caching, help="reuse KV of shared prompt prefixes",
    )
    group.add_argument(
        "--adaptive-speculation", action=argparse.BooleanOptionalAction,
        default=defaults.adaptive_speculation,
        help="choose k <= k_max per sequence and step from measured costs and acceptance",
    )
    group.add_argument(
        "--kernel-tuning", action=argparse.BooleanOptionalAction, default=defaults.kernel_tuning,
        help="time the kernel candidates of each projection shape at start-up (cached per "
             "machine in ~/.cache/specserve/tune)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = {name: getattr(args, name) for name in _ENGINE_FLAGS}
    fields["enable_prefix_caching"] = args.enable_prefix_caching
    fields["adaptive_speculation"] = args.adaptive_speculation
    fields["kernel_tuning"] = args.kernel_tuning
    return EngineConfig(**fields)


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
