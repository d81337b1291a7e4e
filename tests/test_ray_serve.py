"""specserve on a real local Ray cluster: 2 engine replicas (1 CPU each) of the tiny test model
behind the Ray Serve ingress, compared with the single-process aiohttp server on the same
weights (its greedy answers are the reference), then the prefix-affinity router, then a replica
killed mid-run. Ray starts here with a small object store and no dashboard (2-core machine).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed (make test installs it)")
from ray import serve  # noqa: E402

from specserve.scale import ray_serve  # noqa: E402
from specserve.scale.prefix_key import AffinityTable, prefix_hashes  # noqa: E402
from specserve.scale.scale_config import ScaleConfig  # noqa: E402
from specserve.server.server_config import ServerConfig  # noqa: E402
from tests.helpers.servers import NAME, ServerThread, engine_config, http  # noqa: E402

BLOCK = 4  # engine_config's block_size: a 3-block prefix is 12 tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(model_dir: str):
    return engine_config(model_dir, speculative_method="ngram", adaptive_speculation=False)


@pytest.fixture(scope="module")
def cluster(model_dir):
    """The Ray Serve app (2 replicas, prefix router) and the single-process reference server."""
    ray.init(num_cpus=2, object_store_memory=100 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False, runtime_env=ray_serve.source_runtime_env())
    port = _free_port()
    server_cfg = ServerConfig(port=port, served_model_name=NAME, warmup=False)
    ray_serve.start(_engine(model_dir), server_cfg,
                    ScaleConfig(replicas=2, replica_cpus=1, prefix_routing_blocks=4))
    reference = ServerThread(_engine(model_dir), ServerConfig(port=0, served_model_name=NAME))
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", reference=reference.url)
    reference.stop()
    serve.shutdown()
    ray.shutdown()


def sse(url: str, body: dict) -> tuple[int, list[dict | str], str | None]:
    """POSTs a streaming request; returns (status, the data payloads, the serving replica)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events: list[dict | str] = []
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            replica = resp.headers.get("X-Specserve-Replica")
            for line in resp:
                line = line.decode().strip()
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
            return resp.status, events, replica
    except urllib.error.HTTPError as err:
        return err.code, [json.loads(err.read())], None


def stream_text(events: list) -> tuple[str, list]:
    body = [e for e in events if isinstance(e, dict) and e.get("choices")]
    text = "".join((c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
                    or "") for c in body)
    return text, [c["choices"][0]["finish_reason"] for c in body if c["choices"][0][
        "finish_reason"]]


def replicas(url: str) -> dict[str, dict]:
    status, reps = http("GET", url + "/replicas", key=None)
    assert status == 200
    return {r["replica"]: r for r in reps}


@pytest.mark.ray
@pytest.mark.e2e
def test_outputs_equal_single_process_json_and_sse(cluster):
    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        s1, want = http("POST", cluster.reference + "/v1/completions", body, key=None)
        s2, got = http("POST", cluster.url + "/v1/completions", body, key=None)
        assert s1 == s2 == 200
        assert got["choices"] == want["choices"] and got["usage"] == want["usage"]
        sse_body = {**body, "stream_options": {"include_usage": True}}
        s1, ev1, _ = sse(cluster.reference + "/v1/completions", sse_body)
        s2, ev2, replica = sse(cluster.url + "/v1/completions", sse_body)
        assert s1 == s2 == 200 and replica in replicas(cluster.url)
        assert ev1[-1] == ev2[-1] == "[DONE]"
        assert stream_text(ev2) == stream_text(ev1) == (want["choices"][0]["text"], ["length"])
        assert ev2[-2]["usage"] == ev1[-2]["usage"] == want["usage"]
    chat = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}
    s1, want = http("POST", cluster.reference + "/v1/chat/completions", chat, key=None)
    s2, got = http("POST", cluster.url + "/v1/chat/completions", chat, key=None)
    assert s1 == s2 == 200 and got["choices"] == want["choices"]
    s1, ev1, _ = sse(cluster.reference + "/v1/chat/completions", chat)
    s2, ev2, _ = sse(cluster.url + "/v1/chat/completions", chat)
    assert stream_text(ev2) == stream_text(ev1) == (want["choices"][0]["message"]["content"],
                                                    ["length"])
    # errors keep the OpenAI shape and status through the ingress
    bad = {"prompt": "x", "max_tokens": -1}
    s1, e1 = http("POST", cluster.reference + "/v1/completions", bad, key=None)
    s2, e2 = http("POST", cluster.url + "/v1/completions", bad, key=None)
    assert s1 == s2 == 400 and e1 == e2


@pytest.mark.ray
@pytest.mark.e2e
def test_health_models_metrics(cluster):
    status, h = http("GET", cluster.url + "/health", key=None)
    assert status == 200 and h["status"] == "ok" and h["kv_blocks_total"] == 2 * 1024
    status, models = http("GET", cluster.url + "/v1/models", key=None)
    assert status == 200 and models["data"][0]["id"] == NAME
    assert models["data"][0]["max_model_len"] == 256
    status, text = http("GET", cluster.url + "/metrics", key=None)
    assert status == 200
    for rid in replicas(cluster.url):
        for series in ("specserve_replica_prefix_cache_hits_total",
                       "vllm:num_requests_waiting", "vllm:num_requests_running",
                       "vllm:gpu_cache_usage_perc"):
            assert f'{series}{{replica="{rid}"}}' in text, (series, rid)


@pytest.mark.ray
@pytest.mark.e2e
def test_shared_prefix_lands_on_one_replica(cluster):
    """Eight requests whose first 3 KV blocks (12 tokens) are equal and whose tails differ:
    one replica gets them all and serves 12 prompt tokens of every one but the first from its
    prefix cache; the other replica sees none of them."""
    before = replicas(cluster.url)
    assert len(before) == 2
    shared = [101 + i for i in range(3 * BLOCK)]
    served = []
    for i in range(8):
        body = {"prompt": shared + [900 + i, 950 + i, 990 + i], "max_tokens": 2,
                "temperature": 0}
        status, events, replica = sse(cluster.url + "/v1/completions", body)
        assert status == 200 and events[-1] == "[DONE]"
        served.append(replica)
    assert len(set(served)) == 1
    after = replicas(cluster.url)
    hits = {r: after[r]["stats"]["prefix_hit_tokens"] - before[r]["stats"]["prefix_hit_tokens"]
            for r in before}
    queries = {r: after[r]["stats"]["prefix_query_tokens"]
               - before[r]["stats"]["prefix_query_tokens"] for r in before}
    owner, other = served[0], next(r for r in before if r != served[0])
    assert hits[owner] == 7 * 3 * BLOCK and queries[owner] == 8 * 15
    assert hits[other] == 0 and queries[other] == 0


def test_affinity_spills_over_past_the_imbalance_and_forgets_dead_replicas():
    """The router's choice rule (prefix_key.AffinityTable), with loads set by hand."""
    load = {"a": 0, "b": 0}
    table = AffinityTable(imbalance=1)
    shared = prefix_hashes(list(range(12)), BLOCK, 4)
    assert len(shared) == 3  # 12 tokens: three full blocks, the 4th is not full

    def send(hashes: tuple[int, ...]) -> str:
        chosen = table.choose(hashes, ["a", "b"], load.__getitem__)
        load[chosen] += 1
        return chosen

    first = send(shared)
    other = "b" if first == "a" else "a"
    # load 1 vs 0 is within the imbalance; a longer prompt with the same 3 blocks follows
    # its deepest known block
    assert send(prefix_hashes(list(range(12)) + [7, 7, 7, 7], BLOCK, 4)) == first
    assert send(shared) == other  # load 2 vs 0 > 1: spills over, and now owns it too
    load[first] = 0
    assert send(shared) == first  # both own it: the less loaded owner
    load[first] = 5
    assert send(prefix_hashes([5] * 12, BLOCK, 4)) == other  # unknown prefix: least loaded
    table.forget(other)
    assert all(o == [first] for h, o in table.owners.items() if h in shared)
    assert not any(other in o for o in table.owners.values())


@pytest.mark.ray
@pytest.mark.e2e
def test_replica_killed_mid_run_loses_no_request(cluster):
    """Requests in flight on a killed replica end with an OpenAI error (JSON 503, or an SSE
    error event then [DONE]); the others complete; new requests go to the survivor; Ray
    restarts the replica."""
    before = replicas(cluster.url)
    n_tokens = 200  # long enough that the victim is still streaming when it is killed
    bodies = [{"prompt": f"Request number {i} says", "max_tokens": n_tokens, "temperature": 0,
               "ignore_eos": True} for i in range(8)]
    victim: dict[str, str] = {}

    def streaming(body: dict):
        req = urllib.request.Request(cluster.url + "/v1/completions",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        events = []
        with urllib.request.urlopen(req, timeout=120) as resp:
            replica = resp.headers.get("X-Specserve-Replica")
            for line in resp:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 2 and not victim:  # in flight: kill its replica now
                    victim["id"] = replica
                    name = f"SERVE_REPLICA::{ray_serve.APP_NAME}#EngineReplica#{replica}"
                    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)
        return "sse", replica, events

    def plain(body: dict):
        return ("json", *http("POST", cluster.url + "/v1/completions", body, key=None))

    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(streaming if i % 2 == 0 else plain, b)
                for i, b in enumerate(bodies)]
        results = [f.result() for f in futs]
    assert victim, "no stream started"
    completed = errored = 0
    for kind, a, b in results:
        if kind == "sse":
            events = b
            assert events[-1] == "[DONE]"
            text, reasons = stream_text(events)
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            if errors:
                assert a == victim["id"] and errors[0]["error"]["code"] == "replica_failed"
                errored += 1
            else:
                assert reasons == ["length"]
                completed += 1
        else:
            status, resp = a, b
            if status == 200:
                assert resp["usage"]["completion_tokens"] == n_tokens
                completed += 1
            else:
                assert status == 503 and resp["error"]["code"] == "replica_failed", resp
                errored += 1
    assert completed + errored == len(bodies) and errored >= 1
    print(f"killed {victim['id']}: {completed} completed, {errored} ended with an error")
    # the run goes on: new requests are answered by the survivor
    survivor = next(r for r in before if r != victim["id"])
    for i in range(3):
        status, events, replica = sse(cluster.url + "/v1/completions",
                                      {"prompt": f"after {i}", "max_tokens": 4,
                                       "temperature": 0})
        assert status == 200 and events[-1] == "[DONE]"
        assert replica == survivor or replica not in before  # the survivor or the restarted one
    # Ray Serve replaces the killed replica (a new id) and both serve again
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        now = replicas(cluster.url)
        if len(now) == 2 and victim["id"] not in now and all(
                r["state"] == "ok" for r in now.values()):
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed replica was not replaced: {replicas(cluster.url)}")


def test_ray_front_end_reuses_the_transport_neutral_modules():
    """ray_serve.py answers through api.py / replies.py, never through the aiohttp module."""
    from tests.helpers.module_graph import PKG, imported_modules

    for name in ("server/replies.py", "scale/ray_serve.py", "scale/ray_router.py",
                 "scale/prefix_key.py"):
        assert "specserve.server.app" not in imported_modules(PKG / name), name
    assert {"specserve.server.api", "specserve.server.replies"} <= imported_modules(
        PKG / "scale" / "ray_serve.py")


def test_scale_flags_map_onto_scale_config(capsys):
    from specserve.cli import build_parser, main, scale_config_from_args

    args = build_parser().parse_args(
        ["serve", "--replicas", "3", "--replica-cpus", "2", "--replica-gpus", "1",
         "--request-router", "pow2", "--prefix-routing-blocks", "2",
         "--prefix-routing-imbalance", "7", "--ray-address", "auto"])
    assert scale_config_from_args(args) == ScaleConfig(
        replicas=3, replica_cpus=2, replica_gpus=1, request_router="pow2",
        prefix_routing_blocks=2, prefix_routing_imbalance=7, ray_address="auto")
    assert ScaleConfig().uses_ray is False and ScaleConfig(replicas=2).uses_ray
    assert main(["serve", "--replicas", "0"]) == 2  # a message, not a traceback
    assert "replicas must be >= 1" in capsys.readouterr().err
