"""The OpenAI-compatible server, driven by the official openai client against a real `novainfer serve`.

References are independent: the offline LLM (same checkpoint, same greedy decoding) for expected text and
logprobs, the tokenizer for token counts, and the server's own non-streamed answer for streamed ones.
"""

import asyncio
import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from novainfer import LLM, SamplingParams
from tests.server_utils import FLOAT32, ROOT, RemoteServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    srv = RemoteServer(
        [tiny_qwen2, "--served-model-name", MODEL, *FLOAT32], str(tmp_path_factory.mktemp("server") / "server.log")
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_qwen2):
    return LLM(tiny_qwen2, device="cpu", dtype="float32")


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_models_list(client, tiny_qwen2):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].root == tiny_qwen2


def test_chat_matches_offline_llm(client, offline):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, my name is"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids) and resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert resp.id.startswith("chatcmpl-") and resp.model == MODEL


def test_text_parts_equal_string_content(client):
    as_text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The quick fox"}], **GREEDY
    )
    as_parts = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "The quick"}, {"type": "text", "text": " fox"}]}
        ],
        **GREEDY,
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content


def test_completions_string_list_and_token_ids(client, offline):
    prompts = ["The capital of France is", "def add(a, b):"]
    ids = offline.get_tokenizer().encode("Paged attention")
    ref = offline.generate(
        prompts + [ids], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    one = client.completions.create(model=MODEL, prompt=prompts[0], **GREEDY)
    assert one.choices[0].text == ref[0].outputs[0].text and one.object == "text_completion"
    many = client.completions.create(model=MODEL, prompt=prompts, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1]
    assert [c.text for c in many.choices] == [r.outputs[0].text for r in ref[:2]]
    assert many.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref[:2])
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == ref[2].outputs[0].text


def test_completion_default_max_tokens_is_16(client):
    resp = client.completions.create(model=MODEL, prompt="Hello", temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16


def test_chat_stream_chunks_in_openai_order(client):
    messages = [{"role": "user", "content": "Tell me about paged attention"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert chunks.index(finish[0]) == len(chunks) - 2  # then only the usage chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_completion_stream_equals_whole(client):
    whole = client.completions.create(model=MODEL, prompt="Hello, my name is", **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello, my name is", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_n2_and_seed_reproducibility(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        n=2,
        temperature=1.0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    a = client.chat.completions.create(seed=1234, **kw)
    b = client.chat.completions.create(seed=1234, **kw)
    c = client.chat.completions.create(seed=99, **kw)
    assert [x.index for x in a.choices] == [0, 1]
    texts = lambda r: [x.message.content for x in r.choices]  # noqa: E731
    assert texts(a) == texts(b) and texts(a) != texts(c)
    assert a.usage.completion_tokens == 24
    streamed = list(client.chat.completions.create(seed=1234, stream=True, **kw))
    for i in range(2):
        got = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices and ch.choices[0].index == i)
        assert got == texts(a)[i]


def test_stop_string_whole_and_streamed(client):
    kw = dict(model=MODEL, prompt="Hello", temperature=0, max_tokens=30, extra_body={"ignore_eos": True})
    full = client.completions.create(logprobs=0, **kw).choices[0]
    # a stop string whose first occurrence spans two tokens: a stream must hold its first half back
    offset, stop = 0, None
    for left, right in zip(full.logprobs.tokens, full.logprobs.tokens[1:]):
        offset += len(left)
        candidate = left[-1:] + right[:1]
        if len(candidate) == 2 and full.text.index(candidate) == offset - 1:
            stop = candidate
            break
    assert stop is not None
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full.text[: offset - 1] and cut.finish_reason == "stop"
    streamed = list(client.completions.create(stream=True, stop=[stop], **kw))
    assert "".join(c.choices[0].text for c in streamed) == cut.text  # the stop string never leaks into a delta


def test_chat_logprobs_match_offline(client, offline):
    messages = [{"role": "user", "content": "Hello"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=3, **GREEDY)
    ref = offline.chat(
        messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    content = resp.choices[0].logprobs.content
    assert len(content) == 12
    for entry, tid, lp in zip(content, ref.token_ids, ref.logprobs):
        assert entry.logprob == pytest.approx(lp[tid].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy took the best
        assert [t.logprob for t in entry.top_logprobs] == sorted([t.logprob for t in entry.top_logprobs], reverse=True)


def test_completion_logprobs_shape(client):
    resp = client.completions.create(model=MODEL, prompt="Hello", logprobs=2, **GREEDY)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == resp.choices[0].text
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(x) for t, x in zip(lp.top_logprobs, lp.token_logprobs))


def test_32_concurrent_streams_equal_their_greedy_text(server):
    """Async client, chat for even requests and completions for odd ones, all streamed at once."""

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        prompts = [f"Request number {i}: the quick brown fox" for i in range(32)]

        def create(i: int, **kw):
            if i % 2:
                return client.completions.create(model=MODEL, prompt=prompts[i], **GREEDY, **kw)
            return client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompts[i]}], **GREEDY, **kw
            )

        def text(choice) -> str:
            return choice.text if hasattr(choice, "text") else (choice.delta.content or "")

        async def stream(i: int):
            chunks = [c async for c in await create(i, stream=True)]
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
            return chunks[0].id, "".join(text(c.choices[0]) for c in chunks), finishes

        streamed = await asyncio.gather(*(stream(i) for i in range(32)))
        whole = await asyncio.gather(*(create(i) for i in range(32)))
        await client.close()
        return streamed, whole

    streamed, whole = asyncio.run(main())
    assert len({s[0] for s in streamed}) == 32  # none lost, none duplicated
    for i, ((_, text, finishes), ref) in enumerate(zip(streamed, whole)):
        assert finishes == ["length"]
        assert text == (ref.choices[0].text if i % 2 else ref.choices[0].message.content)
    assert server.wait_idle() == 0.0


def _slow_stream_body(**extra):
    return {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


@pytest.mark.parametrize("by", ["x-request-id", "response id"])
def test_cancel_endpoint_stops_stream_and_frees_kv(server, by):
    aborts = server.metric("novainfer:request_success_total", finished_reason="abort")
    events = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream(
            "POST",
            "/v1/chat/completions",
            headers={"X-Request-Id": "cancel-me"},
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 480,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as resp:
            assert resp.headers["x-request-id"] == "cancel-me"
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    target = "cancel-me" if by == "x-request-id" else json.loads(events[0])["id"]
                    r = http.post(f"/v1/requests/{target}/cancel")
                    assert r.status_code == 200 and r.json()["cancelled"] is True
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])["choices"][0]
    assert last["finish_reason"] == "abort"
    assert len(events) < 100  # stopped long before 480 tokens
    assert server.wait_idle() == 0.0
    assert server.metric("novainfer:request_success_total", finished_reason="abort") == aborts + 1
    assert httpx.post(server.url + "/v1/requests/cancel-me/cancel").status_code == 404  # nothing left to cancel


def test_client_disconnect_aborts_request_and_frees_kv(server):
    aborts = server.metric("novainfer:request_success_total", finished_reason="abort")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=_slow_stream_body()) as resp:
            lines = resp.iter_lines()
            for _ in range(4):
                next(lines)
        # leaving the block closes the connection mid-stream
    assert server.wait_idle() == 0.0
    assert server.metric("novainfer:request_success_total", finished_reason="abort") == aborts + 1
    assert server.metric("novainfer:generation_tokens_total") < 480 * 10  # not run to the end


def test_non_streaming_client_that_leaves_is_aborted(server):
    aborts = server.metric("novainfer:request_success_total", finished_reason="abort")
    body = {k: v for k, v in _slow_stream_body().items() if k != "stream"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.05))
    assert server.wait_idle() == 0.0
    assert server.metric("novainfer:request_success_total", finished_reason="abort") == aborts + 1


def test_session_second_turn_hits_prefix_cache(client, server):
    first = [
        {
            "role": "user",
            "content": "Paged attention stores keys and values in fixed-size blocks. Tell me more about the cache.",
        }
    ]
    kw = dict(model=MODEL, temperature=0, max_tokens=8, extra_body={"session_id": "sess-1", "ignore_eos": True})
    t1 = client.chat.completions.create(messages=first, **kw)
    second = [{"role": "user", "content": "And then?"}]
    t2 = client.chat.completions.create(messages=second, **kw)
    conversation = first + [{"role": "assistant", "content": t1.choices[0].message.content}] + second
    expected = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": conversation}).json()
    assert t2.usage.prompt_tokens == expected["count"]  # the server kept the first turn
    assert t2.usage.prompt_tokens_details.cached_tokens > 0
    fresh = client.chat.completions.create(
        messages=second,
        model=MODEL,
        temperature=0,
        max_tokens=8,
        extra_body={"session_id": "sess-2", "ignore_eos": True},
    )
    assert fresh.usage.prompt_tokens < t2.usage.prompt_tokens


BAD_INPUTS = [
    ("bad json", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400),
    (
        "temperature < 0",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -0.5},
        400,
    ),
    ("top_p > 1", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400),
    ("unknown role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": "hello world " * 400}, 400),
    (
        "prompt plus max_tokens too long",
        "/v1/completions",
        {"model": MODEL, "prompt": "hello world " * 30, "max_tokens": 500},
        400,
    ),
    ("token id outside the vocabulary", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**6]}, 400),
    ("seed beyond 64 bits", "/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2**70}, 400),
    ("too many logprobs", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 1000}, 400),
    (
        "too many top_logprobs",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
        400,
    ),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_get_openai_errors_and_server_survives(server, client, name, path, body, status):
    headers = {"X-Request-Id": f"bad-{status}", "content-type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert r.headers["x-request-id"] == f"bad-{status}" and err["request_id"] == f"bad-{status}"
    if name.startswith("prompt"):
        assert "512" in err["message"] and ("2800" in err["message"] or "710" in err["message"])  # both numbers
    if name == "unknown model":
        assert MODEL in err["message"]
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_metrics_move_as_requests_complete(server, client):
    before_prompt = server.metric("novainfer:prompt_tokens_total", model_name=MODEL)
    before_gen = server.metric("novainfer:generation_tokens_total", model_name=MODEL)
    before_len = server.metric("novainfer:request_success_total", model_name=MODEL, finished_reason="length")
    before_ttft = server.metric("novainfer:time_to_first_token_seconds_count", model_name=MODEL)
    resp = client.completions.create(model=MODEL, prompt="The quick brown fox", **GREEDY)
    server.wait_idle()
    assert server.metric("novainfer:prompt_tokens_total", model_name=MODEL) == before_prompt + resp.usage.prompt_tokens
    assert server.metric("novainfer:generation_tokens_total", model_name=MODEL) == before_gen + 12
    assert (
        server.metric("novainfer:request_success_total", model_name=MODEL, finished_reason="length") == before_len + 1
    )
    assert server.metric("novainfer:time_to_first_token_seconds_count", model_name=MODEL) == before_ttft + 1
    assert server.metric("novainfer:prefix_cache_queries_total", model_name=MODEL) > 0
    assert '"event": "request_finished"' in server.log()


def test_tokenize_detokenize_version_health_openapi(server, offline):
    tok = offline.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200
    spec = httpx.get(server.url + "/openapi.json").json()
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/v1/requests/{request_id}/cancel",
    ):
        assert path in spec["paths"]
    assert all("422" not in op["responses"] for ops in spec["paths"].values() for op in ops.values())
    assert "400" in spec["paths"]["/v1/completions"]["post"]["responses"]
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_completion_tokens", "stream_options", "session_id", "top_logprobs"} <= set(props)
    # no /docs or /redoc (their pages need a CDN); the banner names what is served
    assert [httpx.get(server.url + p).status_code for p in ("/docs", "/redoc")] == [404, 404]
    assert f"(schema {server.url}/openapi.json, metrics {server.url}/metrics)" in server.log()


def test_serving_benchmark_reports_latencies(server, tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "serving.py"),
            "--base-url",
            server.url,
            "--num-prompts",
            "6",
            "--request-rate",
            "50",
            "--max-concurrency",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["output_throughput_tok_s"] > 0
    assert 0 < report["median_ttft_ms"] <= report["p99_ttft_ms"]
    assert report["mean_tpot_ms"] > 0 and report["mean_itl_ms"] > 0


def test_unknown_route_and_method_get_openai_errors(server):
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/chat/completions", 405)):
        r = httpx.request(method, server.url + path)
        assert r.status_code == status and r.headers["x-request-id"]
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
