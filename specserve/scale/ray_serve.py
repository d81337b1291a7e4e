"""specserve on Ray Serve: N engine replicas behind one OpenAI-compatible ingress.

    HTTP -> Ray Serve proxy -> Ingress (auth, routing key) --handle + PrefixAffinityRouter-->
        EngineReplica x N (one AsyncEngine each; replies.py builds the JSON / SSE bytes)

The replicas answer exactly as the single-process server does: the same ``api.Server`` parses
and admits, the same ``replies.Reply`` writes the body, and the ingress relays the bytes.

Failure: when a replica dies, Ray Serve drops it from routing and restarts it (``check_health``
also fails a replica whose engine thread died). A request whose replica dies before its first
byte is sent once more, to a live replica (nothing was emitted, so nothing is duplicated); one
that dies mid-answer ends with an OpenAI error: a 503 JSON body, or an SSE error event followed
by ``data: [DONE]``.

Per-replica counters: ``GET /replicas`` (JSON) and ``GET /metrics`` (Prometheus, one
``replica`` label per replica) read every replica through calls pinned by rank (ray_router.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import ray
import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from specserve.core.config import EngineConfig
from specserve.core.errors import SpecServeError
from specserve.engine.async_engine import AsyncEngine, EngineStats
from specserve.scale.prefix_key import PrefixKeyer
from specserve.scale.ray_router import PrefixAffinityRouter
from specserve.scale.scale_config import ScaleConfig
from specserve.server import responses as R
from specserve.server.api import ApiError, Server
from specserve.server.metrics import CONTENT_TYPE, gateway_gauges
from specserve.server.replies import SSE_DONE, SSE_HEADERS, error_body, open_reply, sse_frame
from specserve.server.server_config import ServerConfig

log = structlog.get_logger("specserve.ray")
APP_NAME = "specserve"
_enc = msgspec.json.Encoder()
_KINDS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


@dataclass
class Head:
    """First item of every replica answer: how the ingress should frame the bytes after it."""

    status: int
    stream: bool  # SSE frames follow; else one JSON document
    replica: str  # the replica's id (X-Specserve-Replica header)


class ReplicaStats(msgspec.Struct):
    """One replica's state as ``GET /replicas`` reports it."""

    replica: str
    state: str  # ok | warming_up | shutting_down | failed
    num_in_flight: int
    max_model_len: int
    stats: EngineStats


class EngineReplica:
    """A Ray Serve replica that owns one ``AsyncEngine`` (its own KV, prefix and suffix cache).
    The constructor returns once the engine is warm, so Ray routes only to ready replicas."""

    async def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                       model: str | None) -> None:
        from specserve.engine.llm_engine import LLMEngine

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        engine = await asyncio.to_thread(LLMEngine, engine_config)
        self.engine = AsyncEngine(engine, server_config.max_queue_len, server_config.warmup)
        self.server = Server(self.engine, server_config, model)
        self.engine.start()
        await self.engine.wait_ready()

    async def generate(self, kind: str, body: bytes, tenant: str = "",
                       prefix: tuple[int, ...] = ()) -> AsyncIterator[Head | bytes]:
        """A ``Head``, then the answer's bytes. ``prefix`` is the routing key (read by the
        router, not here)."""
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        reply, started = None, False
        try:
            reply = await open_reply(self.server, kind, body, tenant)
            if reply.job.stream:
                started = True
                yield Head(200, True, self.replica_id)
                async with aclosing(reply.sse()) as frames:
                    async for frame in frames:
                        yield frame
            else:
                doc = await reply.json()
                yield Head(200, False, self.replica_id)
                yield doc
            status = 200
        except Exception as exc:
            if started:  # mid-stream: the ingress ends the stream with an SSE error event
                self.server.metrics.observe_request(endpoint, 500)
                raise
            status, err = error_body(exc)
            yield Head(status, False, self.replica_id)
            yield err
        finally:
            if reply is not None:
                reply.close()
        self.server.metrics.observe_request(endpoint, status)

    def stats(self, rank: int | None = None) -> ReplicaStats:
        """This replica's counters (``rank`` pins the call; read by the router)."""
        return ReplicaStats(self.replica_id, self.engine.state, self.engine.num_unfinished,
                            self.engine.max_model_len, self.engine.stats)

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it restart the replica."""
        if self.engine.error is not None:
            raise RuntimeError(f"engine thread died: {self.engine.error!r}")

    async def __del__(self) -> None:
        """Ray Serve calls this when it stops the replica (after draining its requests)."""
        engine = getattr(self, "engine", None)  # absent if the constructor failed
        if engine is not None:
            await engine.shutdown()


class _ReplicaCollector(Collector):
    """Per-replica series for the ingress's /metrics, labelled by replica id."""

    def __init__(self, replicas: list[ReplicaStats]) -> None:
        self.replicas = replicas

    def collect(self) -> list[Metric]:
        up = GaugeMetricFamily("specserve_replica_up", "1 when the replica's engine is ready",
                               labels=["replica"])
        hits = CounterMetricFamily("specserve_replica_prefix_cache_hits",
                                   "Prompt tokens served from this replica's prefix cache",
                                   labels=["replica"])
        queries = CounterMetricFamily("specserve_replica_prefix_cache_queries",
                                      "Prompt tokens looked up in this replica's prefix cache",
                                      labels=["replica"])
        gateway: dict[str, GaugeMetricFamily] = {}
        for r in self.replicas:
            up.add_metric([r.replica], 1.0 if r.state == "ok" else 0.0)
            hits.add_metric([r.replica], r.stats.prefix_hit_tokens)
            queries.add_metric([r.replica], r.stats.prefix_query_tokens)
            for m in gateway_gauges(r.stats):  # the gateway's gauges, one series per replica
                fam = gateway.setdefault(
                    m.name, GaugeMetricFamily(m.name, m.documentation, labels=["replica"]))
                fam.add_metric([r.replica], m.samples[0].value)
        return [up, hits, queries, *gateway.values()]


class Ingress:
    """The HTTP entry: the OpenAI routes, /health, /v1/models, /metrics, /replicas."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 scale: ScaleConfig, model: str | None, replicas: Any) -> None:
        from specserve.engine.models import load_tokenizer, resolve_model_path

        self.config, self.scale, self.replicas = server_config, scale, replicas
        self.model_name = server_config.model_name(model)
        self.aliases = {self.model_name, *([model] if model else [])}
        self.tenants = server_config.tenants
        self.started = int(time.time())
        self.keyer: PrefixKeyer | None = None
        if scale.request_router == "prefix":
            tok_path = engine_config.tokenizer or resolve_model_path(engine_config.model)
            tok = load_tokenizer(tok_path, engine_config.chat_template)
            self.keyer = PrefixKeyer(tok, engine_config.block_size,
                                     scale.prefix_routing_blocks)

    async def __call__(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        try:
            tenant = self._tenant(request, path)
            if method == "POST" and path in _KINDS:
                resp = await self._api(request, _KINDS[path], tenant)
            elif method == "GET" and path == "/health":
                resp = await self._health()
            elif method == "GET" and path == "/v1/models":
                resp = await self._models()
            elif method == "GET" and path == "/metrics":
                resp = await self._metrics()
            elif method == "GET" and path == "/replicas":
                resp = _json(_enc.encode(await self.replica_stats()))
            else:
                raise ApiError(404, f"no route {method} {path}", "invalid_request_error",
                               code="not_found")
        except Exception as exc:
            status, err = error_body(exc)
            resp = _json(err, status)
        rid = request.headers.get("x-request-id")
        if rid is not None and len(rid) <= 200:
            resp.headers["X-Request-Id"] = rid
        return resp

    def _tenant(self, request: Request, path: str) -> str:
        if not self.tenants or not path.startswith("/v1/"):
            return ""
        auth = request.headers.get("authorization", "")
        tenant = self.tenants.get(auth[len("Bearer "):]) if auth.startswith("Bearer ") else None
        if tenant is None:
            raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer KEY`",
                           "authentication_error", code="invalid_api_key")
        return tenant

    async def _api(self, request: Request, kind: str, tenant: str) -> Response:
        body = await request.body()
        if len(body) > self.config.max_body_bytes:
            raise ApiError(413, "the request body is too large (see --max-body-bytes)",
                           "invalid_request_error", code="body_too_large")
        prefix = await asyncio.to_thread(self.keyer.key, kind, body) if self.keyer else ()
        for attempt in range(2):
            gen = self.replicas.options(stream=True).generate.remote(
                kind, body, tenant, prefix=prefix)
            try:
                head: Head = await gen.__anext__()
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the replica died before answering: nothing was sent
                log.warning("replica_failed_before_answer", attempt=attempt, error=repr(exc))
                if attempt == 1:
                    return _json(_replica_error(exc), 503)
        headers = {"X-Specserve-Replica": head.replica}
        if head.stream:
            return StreamingResponse(_relay_sse(gen), status_code=head.status,
                                     headers={**SSE_HEADERS, **headers})
        try:
            doc = b"".join([chunk async for chunk in gen])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica died mid-answer
            return _json(_replica_error(exc), 503, headers)
        return _json(doc, head.status, headers)

    async def replica_stats(self) -> list[ReplicaStats]:
        """Every live replica's counters, one pinned call per rank (a rank past the live
        replicas wraps around and is deduplicated; a replica dying meanwhile is skipped). The
        calls go one at a time: Ray pairs a routed replica with its request by the request id,
        which concurrent sub-calls of one ingress request share, so concurrent ones could be
        paired crosswise."""
        seen: dict[str, ReplicaStats] = {}
        for rank in range(self.scale.replicas):
            try:
                s = await asyncio.wait_for(_result(self.replicas.stats.remote(rank=rank)), 10)
            except asyncio.CancelledError:
                raise
            except Exception:
                continue
            seen[s.replica] = s
        return sorted(seen.values(), key=lambda s: s.replica)

    async def _health(self) -> Response:
        """200 while at least one replica is ready (the body sums the live replicas)."""
        reps = await self.replica_stats()
        ready = [r for r in reps if r.state == "ok"]
        body = R.HealthResponse(
            "ok" if ready else (reps[0].state if reps else "failed"),
            sum(r.stats.kv_blocks_free for r in reps), sum(r.stats.kv_blocks_total for r in reps),
            sum(r.stats.num_running for r in reps), sum(r.stats.num_waiting for r in reps),
            sum(r.num_in_flight for r in reps))
        return _json(_enc.encode(body), 200 if ready else 503)

    async def _models(self) -> Response:
        reps = await self.replica_stats()
        max_len = max((r.max_model_len for r in reps), default=0)
        card = R.ModelCard(self.model_name, "model", self.started, "specserve", max_len)
        return _json(_enc.encode(R.ModelList("list", [card])))

    async def _metrics(self) -> Response:
        registry = CollectorRegistry()
        registry.register(_ReplicaCollector(await self.replica_stats()))
        return Response(generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})


async def _result(call: Any) -> Any:
    return await call


async def _relay_sse(gen: Any) -> AsyncIterator[bytes]:
    """Relays a replica's SSE frames; if the replica dies first, one error event and [DONE]."""
    done = False
    try:
        async for frame in gen:
            done = frame == SSE_DONE
            yield frame
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if not done:
            yield sse_frame(_replica_error_response(exc))
            yield SSE_DONE


def _replica_error_response(exc: BaseException) -> R.ErrorResponse:
    return R.ErrorResponse(R.ErrorInfo(
        f"the replica serving this request failed ({type(exc).__name__}); the request was "
        "not completed: retry it (Ray Serve restarts the replica, live replicas take new "
        "requests)", "service_unavailable", code="replica_failed"))


def _replica_error(exc: BaseException) -> bytes:
    return _enc.encode(_replica_error_response(exc))


def _json(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def build_app(engine_config: EngineConfig, server_config: ServerConfig, scale: ScaleConfig,
              model: str | None = None) -> Any:
    """The Ray Serve application (pass it to ``serve.run``)."""
    if not engine_config.num_threads:  # torch threads = the CPUs Ray reserved for it
        engine_config = msgspec.structs.replace(
            engine_config, num_threads=max(1, int(scale.replica_cpus)))
    router = (RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                  request_router_kwargs={
                                      "imbalance": scale.prefix_routing_imbalance})
              if scale.request_router == "prefix" else RequestRouterConfig())
    replica = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=scale.replicas,
        # the engine batches and queues itself; Ray must not cap it below its own admission
        max_ongoing_requests=engine_config.max_num_seqs + server_config.max_queue_len,
        ray_actor_options={"num_cpus": scale.replica_cpus, "num_gpus": scale.replica_gpus},
        request_router_config=router, health_check_period_s=2, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=server_config.shutdown_timeout,
    )
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1,
                               max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine_config, server_config, scale, model,
                        replica.bind(engine_config, server_config, model))


def source_runtime_env() -> dict:
    """Ray workers import specserve from where this process did (a source checkout too)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def start(engine_config: EngineConfig, server_config: ServerConfig, scale: ScaleConfig,
          model: str | None = None, object_store_memory: int | None = None) -> None:
    """Connects to (``scale.ray_address``) or starts a local Ray cluster, starts Serve's HTTP
    proxy on --host/--port and deploys the app; returns once every replica is ready."""
    if not ray.is_initialized():
        env = source_runtime_env()
        if scale.ray_address:
            ray.init(address=scale.ray_address, runtime_env=env)
        else:
            try:  # a cluster already running on this machine (`ray start --head`)
                ray.init(address="auto", runtime_env=env)
            except ConnectionError:  # none: start one, without the dashboard
                ray.init(runtime_env=env, include_dashboard=False,
                         object_store_memory=object_store_memory)
    serve.start(http_options={"host": server_config.host, "port": server_config.port})
    try:
        serve.run(build_app(engine_config, server_config, scale, model), name=APP_NAME,
                  route_prefix="/")
    except RuntimeError as exc:  # Ray gave up on the replicas (their constructor raised)
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        raise SpecServeError(f"the replicas failed to start: {last}") from exc


def run(engine_config: EngineConfig, server_config: ServerConfig, scale: ScaleConfig,
        model: str | None = None) -> int:
    """`specserve serve --replicas N`: serves until Ctrl-C / SIGTERM, then tears Serve down."""
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    start(engine_config, server_config, scale, model)
    log.info("listening", host=server_config.host, port=server_config.port,
             replicas=scale.replicas, router=scale.request_router)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
    return 0
