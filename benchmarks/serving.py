"""Serving benchmark: random-prompt load at a request rate and concurrency against a running server.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \
        --max-concurrency 32 --input-len 128 --output-len 128

Prompts are random token ids drawn from the server's own tokenization of a fixed text, sent to
/v1/completions with stream=true and ignore_eos, so every request generates exactly --output-len tokens.
With --response-format json_schema (or json_object) the same prompts run twice in one invocation: unconstrained
(the baseline), then constrained by benchmarks/serving.py's SCHEMA (objects, enums, booleans, bounded integers,
arrays, a nested object) without ignore_eos; the report gives both and the TPOT ratio, and counts the constrained
outputs that parse and validate (jsonschema).
Reports TTFT, TPOT and ITL (mean, median and --metric-percentiles, p50 and p99 by default, in ms), request and
output-token throughput, and how many requests the server refused with 429 (its admission bounds; with how long
the refusal took) or failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks; "
    "continuous batching admits new requests at every step, and a prefix cache shares equal prompts. "
)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "active", "tags", "address"],
    "additionalProperties": False,
}
RESPONSE_FORMATS = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    "json_object": {"type": "json_object"},
}


@dataclass
class Result:
    ok: bool = False
    status: int = 0  # HTTP status; 0 when the connection itself failed
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""


async def one_request(
    http: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, response_format: dict | None = None
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if response_format is not None:  # a constrained output ends where its grammar does
        body.update(response_format=response_format, ignore_eos=False)
    res, start = Result(), time.perf_counter()
    last = start
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.latency = time.perf_counter() - start  # for a 429: how promptly the refusal came
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                res.text += chunk["choices"][0]["text"]
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as exc:
        res.error = f"{exc!r} after {time.perf_counter() - start:.3f} s ({len(res.text)} chars streamed)"
    return res


def summarize(name: str, values: list[float], percentiles: tuple[float, ...] = (50, 99)) -> dict[str, float]:
    """Mean, median and percentiles (linear between ranks, as numpy and vLLM) of values (seconds) in ms."""
    ordered = sorted(values) or [0.0]
    report = {
        f"mean_{name}_ms": 1000 * statistics.fmean(ordered),
        f"median_{name}_ms": 1000 * statistics.median(ordered),
    }
    for q in percentiles:
        pos = q / 100 * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        report[f"p{q:g}_{name}_ms"] = 1000 * (ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return report


async def run(args: argparse.Namespace) -> dict:
    """The load once, or (with --response-format) unconstrained then constrained, with the TPOT ratio."""
    if args.response_format is None:
        return await run_load(args, None)
    report: dict = {}
    ratios = []
    for r in range(args.rounds):  # alternate, so a noisy machine's drift hits both sides alike
        base = await run_load(args, None)
        constrained = await run_load(args, RESPONSE_FORMATS[args.response_format], args.constrained_output_len)
        ratios.append(constrained["mean_tpot_ms"] / base["mean_tpot_ms"])
        report.update({f"r{r}_unconstrained_{k}": v for k, v in base.items() if "tpot" in k or k == "completed"})
        report.update(
            {
                f"r{r}_constrained_{k}": v
                for k, v in constrained.items()
                if "tpot" in k or k in ("completed", "valid_outputs", "mean_output_tokens")
            }
        )
    report["tpot_ratio_per_round"] = ", ".join(f"{x:.3f}" for x in ratios)
    report["tpot_ratio_median"] = statistics.median(ratios)
    return report


def count_valid(texts: list[str], response_format: str) -> int:
    """Outputs that parse as JSON objects (and, for json_schema, validate against SCHEMA)."""
    import jsonschema

    valid = 0
    for text in texts:
        try:
            obj = json.loads(text)
            if response_format == "json_schema":
                jsonschema.validate(obj, SCHEMA)
            valid += isinstance(obj, dict)
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid


async def run_load(args: argparse.Namespace, response_format: dict | None, output_len: int | None = None) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None)  # httpx's default of 100 would queue a larger load in the client
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        vocab = (await http.post("/tokenize", json={"model": model, "prompt": SEED_TEXT})).json()["tokens"]
        if len(set(vocab)) < 2:  # a random checkpoint's word-level tokenizer knows no English: any low id will do
            vocab = list(range(2, 500))
        rng = random.Random(args.seed)
        prompts = [[rng.choice(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
        limit = asyncio.Semaphore(args.max_concurrency or args.num_prompts)

        async def limited(prompt: list[int]) -> Result:
            async with limit:
                return await one_request(http, model, prompt, output_len or args.output_len, response_format)

        tasks, start = [], time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    done = [r for r in results if r.ok]
    refused = [r for r in results if r.status == 429]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    pct = tuple(float(q) for q in args.metric_percentiles.split(","))
    report = {
        "model": model,
        "completed": len(done),
        "rate_limited_429": len(refused),
        "failed": len(results) - len(done) - len(refused),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput_tok_s": sum(r.output_tokens for r in done) / duration,
        **summarize("ttft", [r.ttft for r in done], pct),
        **summarize("tpot", tpots, pct),
        **summarize("itl", [x for r in done for x in r.itl], pct),
        **summarize("time_to_429", [r.latency for r in refused], pct),
    }
    if response_format is not None:
        report["valid_outputs"] = count_valid([r.text for r in done], args.response_format)
        report["mean_output_tokens"] = statistics.fmean([r.output_tokens for r in done] or [0])
    errors = [r.error for r in results if not r.ok and r.status != 429][:3]
    if errors:
        report["first_errors"] = errors
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", default="50,99", help="comma-separated percentiles to report (vLLM's flag)")
    p.add_argument(
        "--response-format",
        default=None,
        choices=sorted(RESPONSE_FORMATS),
        help="also run the prompts constrained by this response_format and compare TPOT",
    )
    p.add_argument(
        "--constrained-output-len",
        type=int,
        default=256,
        help="max_tokens of the constrained requests (room for the JSON to end)",
    )
    p.add_argument("--rounds", type=int, default=1, help="unconstrained/constrained pairs, alternated")
    p.add_argument("--json", default=None, help="also write the report to this file")
    args = p.parse_args()
    report = asyncio.run(run(args))
    for key, value in report.items():
        print(f"{key:28s} {value:.2f}" if isinstance(value, float) else f"{key:28s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
