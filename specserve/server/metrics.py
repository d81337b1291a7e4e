"""Prometheus metrics for one server (its own ``CollectorRegistry``: no process-global state, so
several apps, e.g. in tests, never share series).

Counters and histograms are fed by the request handlers on the event loop; engine gauges (queue
length, running sequences, KV blocks, prefix-cache hit rate) are read at scrape time from the
``EngineStats`` snapshot the engine thread publishes after each step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.engine.async_engine import EngineStats
from specserve.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int]) -> None:
        self._stats = stats
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("specserve_num_requests_running",
                                "Sequences in the engine's running batch", s.num_running)
        yield GaugeMetricFamily("specserve_num_requests_waiting",
                                "Sequences waiting to be scheduled (queue length)", s.num_waiting)
        yield GaugeMetricFamily("specserve_num_requests_in_flight",
                                "Sequences admitted by the server and not finished",
                                self._in_flight())
        yield GaugeMetricFamily("specserve_kv_blocks_total", "KV cache blocks in the pool",
                                s.kv_blocks_total)
        yield GaugeMetricFamily("specserve_kv_blocks_used", "KV blocks held by live sequences",
                                s.kv_blocks_total - s.kv_blocks_free)
        yield GaugeMetricFamily("specserve_kv_blocks_free",
                                "KV blocks with no live sequence (some hold cached prefixes)",
                                s.kv_blocks_free)
        yield GaugeMetricFamily("specserve_kv_blocks_cached",
                                "KV blocks registered in the prefix cache", s.kv_blocks_cached)
        yield CounterMetricFamily("specserve_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache",
                                  s.prefix_query_tokens)
        yield CounterMetricFamily("specserve_prefix_cache_hits",
                                  "Prompt tokens served from the prefix cache",
                                  s.prefix_hit_tokens)
        yield CounterMetricFamily("specserve_engine_step_failures",
                                  "Engine steps that raised; their requests ended with an error",
                                  s.step_failures)
        rate = s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0
        yield GaugeMetricFamily("specserve_prefix_cache_hit_rate",
                                "Prefix-cache hits / queries, in tokens, since start", rate)
        yield from gateway_gauges(s)


def gateway_gauges(s: EngineStats) -> Iterator[Metric]:
    """The gauges the Kubernetes Gateway API Inference Extension's endpoint picker scrapes
    (its model-server protocol), under the names it reads from vLLM-compatible servers, so a
    gateway routes to specserve pods without a custom adapter. Same numbers as ours above."""
    used = (s.kv_blocks_total - s.kv_blocks_free) / s.kv_blocks_total if s.kv_blocks_total else 0.0
    yield GaugeMetricFamily("vllm:num_requests_waiting",
                            "Requests waiting to be scheduled (TotalQueuedRequests)",
                            s.num_waiting)
    yield GaugeMetricFamily("vllm:num_requests_running",
                            "Requests in the running batch (TotalRunningRequests)", s.num_running)
    # Both names: older gateways read gpu_cache_usage_perc, newer vLLM calls it kv_cache_...
    for name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"):
        yield GaugeMetricFamily(name, "KV-cache blocks held by live sequences / all blocks "
                                "(KVCacheUtilization; 1 = full)", used)


class ServerMetrics:
    """All series of one server. ``observe_*`` are called on the event loop only."""

    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("specserve_requests", "API requests by endpoint and status",
                                ["endpoint", "status"], registry=reg)
        self.finished = Counter("specserve_sequences_finished",
                                "Finished sequences by finish reason", ["finish_reason"],
                                registry=reg)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens processed",
                                     registry=reg)
        self.generation_tokens = Counter("specserve_generation_tokens", "Tokens generated",
                                         registry=reg)
        self.spec_drafted = Counter("specserve_spec_decode_draft_tokens",
                                    "Draft tokens proposed and verified", registry=reg)
        self.spec_accepted = Counter("specserve_spec_decode_accepted_tokens",
                                     "Draft tokens accepted by the target", registry=reg)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS + (20.0, 40.0), registry=reg)
        self.itl = Histogram("specserve_inter_token_latency_seconds",
                             "Time between successive streamed outputs, per token",
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("specserve_time_per_output_token_seconds",
                              "(e2e - ttft) / (output tokens - 1), per sequence",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds",
                             "Arrival to last token, per sequence", buckets=_E2E_BUCKETS,
                             registry=reg)
        self.timeouts = Counter("specserve_request_timeouts",
                                "Requests aborted at their deadline (their timeout field or "
                                "--request-timeout)", registry=reg)
        reg.register(_EngineCollector(stats, in_flight))

    def observe_request(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_timeout(self) -> None:
        self.timeouts.inc()

    def observe_gap(self, seconds: float, num_tokens: int) -> None:
        """One streamed output that carried ``num_tokens`` new tokens ``seconds`` after the
        previous one (several tokens at once after an accepted speculation)."""
        if num_tokens > 0:
            per_token = seconds / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(per_token)

    def observe_finished(self, out: RequestOutput) -> None:
        t = out.timings
        self.finished.labels(finish_reason=out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(out.num_output_tokens)
        self.spec_drafted.inc(t.num_drafted)
        self.spec_accepted.inc(t.num_accepted)
        if t.ttft_ms is not None:
            self.ttft.observe(t.ttft_ms / 1e3)
        if t.e2e_ms is not None:
            self.e2e.observe(t.e2e_ms / 1e3)
            if t.ttft_ms is not None and out.num_output_tokens > 1:
                self.tpot.observe((t.e2e_ms - t.ttft_ms) / 1e3 / (out.num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
