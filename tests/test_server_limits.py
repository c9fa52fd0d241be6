"""A server with an API key, tight admission limits and two models: 401, 429 with Retry-After, routing."""

import asyncio

import httpx
import openai
import pytest

from novainfer import LLM, SamplingParams
from tests.server_utils import RemoteServer

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tiny_qwen2, tiny_llama, tmp_path_factory):
    srv = RemoteServer(
        [
            tiny_qwen2,
            "--model",
            tiny_llama,
            "--served-model-name",
            "qwen",
            "llama",
            "--api-key",
            KEY,
            "--max-concurrent-requests",
            "1",
            "--max-queue-len",
            "1",
        ],
        str(tmp_path_factory.mktemp("server_limits") / "server.log"),
    )
    yield srv
    srv.stop()


def make_client(server, key=KEY):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_missing_or_wrong_key_is_401(server):
    for key in ("wrong-key", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(server.url + "/v1/completions", json={"model": "qwen", "prompt": "hi"}, headers=headers)
        assert r.status_code == 401
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
        assert r.headers["x-request-id"]
    with pytest.raises(openai.AuthenticationError):
        make_client(server, "wrong-key").models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open
    assert [m.id for m in make_client(server).models.list().data] == ["qwen", "llama"]


def test_requests_route_by_model(server, tiny_qwen2, tiny_llama):
    client = make_client(server)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for name, path in (("qwen", tiny_qwen2), ("llama", tiny_llama)):
        ref = LLM(path, device="cpu").generate(["Hello, my name is"], params, use_tqdm=False)[0].outputs[0].text
        got = (
            client.completions.create(
                model=name, prompt="Hello, my name is", temperature=0, max_tokens=10, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )
        assert got == ref, name
    with pytest.raises(openai.NotFoundError, match="qwen, llama"):
        client.completions.create(model="missing", prompt="hi")


def test_overload_gets_429_with_retry_after_then_recovers(server):
    body = {"model": "qwen", "prompt": "Hello", "max_tokens": 480, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(
            base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
        ) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(5)))

    responses = asyncio.run(main())
    statuses = sorted(r.status_code for r in responses)
    # one runs, one waits in the queue of length 1, the rest are refused at once: nothing queues unboundedly
    assert statuses == [200, 200, 429, 429, 429], statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 480
    ok = make_client(server).completions.create(model="qwen", prompt="Hello", max_tokens=3)
    assert ok.usage.completion_tokens <= 3
