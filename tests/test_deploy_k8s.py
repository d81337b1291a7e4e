"""The Kubernetes contract: the manifests in deploy/k8s/ are valid Kubernetes objects (strict
schema check with kubernetes-validate, offline), probe /health on the port the server listens
on, and a real server's /metrics carries the gauges the Gateway API Inference Extension reads
(vllm:num_requests_waiting / _running, vllm:gpu_cache_usage_perc), equal to /health's numbers.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specserve.engine.async_engine import EngineStats
from specserve.server.metrics import ServerMetrics
from specserve.server.server_config import ServerConfig
from tests.helpers.servers import GOOD, NAME, ServerThread, engine_config, http

MANIFESTS = sorted((Path(__file__).parent.parent / "deploy" / "k8s").glob("*.yaml"))


def _docs() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def test_manifests_are_valid_kubernetes_objects():
    assert MANIFESTS
    version = kubernetes_validate.latest_version()
    for doc in _docs():
        kubernetes_validate.validate(doc, version, strict=True)  # raises with the field
    kinds = sorted(d["kind"] for d in _docs())
    assert kinds == ["Deployment", "Service"]


def test_manifests_probe_health_on_the_served_port():
    docs = {d["kind"]: d for d in _docs()}
    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    port = int(args[args.index("--port") + 1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert ports.get(get["port"], get["port"]) == port, probe
    assert args[args.index("--host") + 1] == "0.0.0.0"  # reachable from the kubelet
    service = docs["Service"]["spec"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    assert all(ports.get(p["targetPort"], p["targetPort"]) == port for p in service["ports"])


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(engine_config(model_dir), ServerConfig(port=0, served_model_name=NAME))
    yield srv
    srv.stop()


@pytest.mark.e2e
def test_metrics_carry_the_gateway_gauges(server):
    assert http("POST", server.url + "/v1/completions", GOOD, key=None)[0] == 200
    status, text = http("GET", server.url + "/metrics", key=None)
    assert status == 200
    values = {s.name: s.value for fam in text_string_to_metric_families(text)
              for s in fam.samples}
    status, health = http("GET", server.url + "/health", key=None)
    assert status == 200
    used = 1 - health["kv_blocks_free"] / health["kv_blocks_total"]
    assert values["vllm:num_requests_waiting"] == health["num_waiting"]
    assert values["vllm:num_requests_running"] == health["num_running"]
    assert values["vllm:gpu_cache_usage_perc"] == pytest.approx(used)
    assert values["vllm:kv_cache_usage_perc"] == pytest.approx(used)
    assert values["specserve_num_requests_waiting"] == health["num_waiting"]


def test_gateway_gauges_follow_the_engine_snapshot():
    """Busy numbers (a live server is idle between test requests): 3 waiting, 5 running,
    600 of 1000 blocks held."""
    stats = EngineStats(num_running=5, num_waiting=3, kv_blocks_total=1000, kv_blocks_free=400)
    text = ServerMetrics(lambda: stats, lambda: 8).render().decode()
    values = {s.name: s.value for fam in text_string_to_metric_families(text)
              for s in fam.samples}
    assert values["vllm:num_requests_waiting"] == 3
    assert values["vllm:num_requests_running"] == 5
    assert values["vllm:gpu_cache_usage_perc"] == values["vllm:kv_cache_usage_perc"] == 0.6
