"""vLLM's metric names beside NovaInfer's, as the routers read them: types, labels, and gauges that follow
requests as they queue (front-end and engine), run and finish."""

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import FLOAT32, RemoteServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    # one sequence runs; two are admitted (one waits in the engine), a third waits for an admission slot
    srv = RemoteServer(
        [
            tiny_qwen2,
            *FLOAT32,
            "--served-model-name",
            MODEL,
            "--max-num-seqs",
            "1",
            "--max-concurrent-requests",
            "2",
            "--num-gpu-blocks-override",
            "64",
        ],
        str(tmp_path_factory.mktemp("vllm_metrics") / "server.log"),
    )
    yield srv
    srv.stop()


def families(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, **labels: str) -> float:
    """The sample `name` (the family's name plus _total/_count/... as exposed) with these labels, summed."""
    return sum(
        s.value
        for f in fams.values()
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_types_and_labels(server):
    httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0},
        timeout=30,
    ).raise_for_status()
    fams = families(server)
    expected = {
        "num_requests_waiting": "gauge",
        "num_requests_running": "gauge",
        "kv_cache_usage_perc": "gauge",
        "cache_config_info": "gauge",
        "prefix_cache_queries": "counter",
        "prefix_cache_hits": "counter",
        "prompt_tokens": "counter",
        "generation_tokens": "counter",
        "request_success": "counter",
        "time_to_first_token_seconds": "histogram",
        "time_per_output_token_seconds": "histogram",
        "e2e_request_latency_seconds": "histogram",
    }
    for name, kind in expected.items():
        for prefix in ("vllm", "novainfer"):
            fam = fams.get(f"{prefix}:{name}")
            assert fam is not None and fam.type == kind, (prefix, name, fam and fam.type)
            assert all(s.labels.get("model_name") == MODEL for s in fam.samples), name
    assert fams["vllm:request_time_per_output_token_seconds"].type == "histogram"
    (info,) = fams["vllm:cache_config_info"].samples
    assert info.value == 1
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "64"
    assert info.labels["enable_prefix_caching"] == "True"
    assert value(fams, "vllm:request_success_total", finished_reason="length") >= 1
    assert value(fams, "vllm:generation_tokens_total") >= 4
    assert value(fams, "vllm:prompt_tokens_total") == value(fams, "novainfer:prompt_tokens_total") > 0
    assert value(fams, "vllm:e2e_request_latency_seconds_count") >= 1


def test_gauges_follow_queueing_running_and_finishing(server):
    body = {
        "model": MODEL,
        "prompt": "Count with me: one two three",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    statuses: list[int] = []

    def send() -> None:
        statuses.append(httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code)

    before = value(families(server), "vllm:prefix_cache_queries_total")
    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        fams = families(server)
        seen.append(
            (
                value(fams, "vllm:num_requests_running"),
                value(fams, "vllm:num_requests_waiting"),
                value(fams, "vllm:kv_cache_usage_perc"),
            )
        )
        if seen[-1][:2] == (1, 2):
            break
        time.sleep(0.02)
    assert seen[-1][:2] == (1, 2), seen[-5:]  # 1 in the engine's batch, 1 in its queue, 1 at the admission gate
    assert 0 < seen[-1][2] <= 1
    for t in threads:
        t.join()
    assert statuses == [200, 200, 200]
    fams = families(server)
    assert (value(fams, "vllm:num_requests_running"), value(fams, "vllm:num_requests_waiting")) == (0, 0)
    assert value(fams, "vllm:kv_cache_usage_perc") == 0
    queries = value(fams, "vllm:prefix_cache_queries_total") - before
    assert queries >= 3 * 7 and value(fams, "vllm:prefix_cache_hits_total") > 0  # the same prompt, thrice


def test_router_added_fields_pass_at_their_defaults_only(server):
    """The bodies sglang-router / vllm-router forward (captured from both): SGLang's fields at their defaults."""
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 3,
        "stream": False,
        "logprobs": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
    }
    completion = {
        "model": MODEL,
        "prompt": "hi there",
        "max_tokens": 3,
        "temperature": 0.0,
        "stream": False,
        "echo": False,
        "no_stop_trim": False,
        "ignore_eos": True,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    }
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
    assert httpx.post(server.url + "/v1/completions", json=completion, timeout=30).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={**completion, "no_stop_trim": True}, timeout=30)
    assert r.status_code == 400 and "no_stop_trim" in r.json()["error"]["message"]
