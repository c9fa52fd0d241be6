"""The `novainfer` command: serve (the OpenAI-compatible server), generate (one prompt), chat (a terminal loop)."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from novainfer.config import ServerConfig
from novainfer.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """vLLM's engine flags, shared by every subcommand that loads a model."""
    help_ = "HF folder or .gguf file (default: SmolLM2-135M-Instruct, shipped with the install)"
    if model_positional:
        p.add_argument("model", nargs="?", default=None, help=help_)
    else:  # the positional arguments are prompts
        p.add_argument("--model", default=None, help=help_)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV-cache blocks to allocate instead of sizing from memory (testing preemption)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--distributed-executor-backend", default="uni", choices=["uni", "mp", "ray"],
                   help="uni: every rank in this process; mp: one process per device (torch.distributed)")
    p.add_argument("--tensor-parallel-device-ids", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated CUDA device ids of this node's ranks (default 0..n-1)")
    p.add_argument("--nnodes", type=int, default=1, help="mp: machines the ranks span")
    p.add_argument("--node-rank", type=int, default=0, help="mp: this machine's index (0 runs the engine)")
    p.add_argument("--master-addr", default="127.0.0.1", help="mp: address of node 0 for the rendezvous")
    p.add_argument("--master-port", type=int, default=29501, help="mp: port of node 0 for the rendezvous")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="refused above 1: run one server per "
                   "replica behind a router (docs/DEPLOY.md)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan step N+1 while step N runs (default: on with CUDA, off on the CPU)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: a config-only folder, weights drawn at random in place (benchmarks)")
    p.add_argument("--quantization", default=None, choices=["gguf", "fp8", "none"],
                   help="GGUF on the CPU: keep blocks quantized (default unless --dtype float32) or dequantize; "
                        "fp8: a bf16/fp16 checkpoint's linear weights to float8 at load (CUDA sm_89+, or the CPU)")
    p.add_argument("--cpu-kv-cache-tokens", type=int, default=32768, help="KV cache capacity on the CPU, in tokens")
    p.add_argument("--trim-heap-when-idle", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine core process gives its freed step workspaces back to the system when it goes "
                        "idle (glibc malloc_trim)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the model's dtype; bfloat16 on the CPU unless --dtype float32")
    p.add_argument("--speculative-config", default=None, type=_json_object,
                   help='speculative decoding as JSON, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        'or {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}')
    p.add_argument("--kv-events-config", default=None, type=_json_object,
                   help='publish KV-cache events as vLLM does, JSON: \'{"enable_kv_cache_events": true, '
                        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (docs/DEPLOY.md)')
    p.add_argument("--fault-injection", default=None, help=argparse.SUPPRESS)  # tests only: engine/faults.py


def _json_object(text: str) -> dict:
    """--speculative-config's value: a JSON object (argparse turns the ValueError into a usage error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine's keyword arguments from the flags."""
    if args.data_parallel_size > 1:
        raise SystemExit(f"--data-parallel-size {args.data_parallel_size}: not supported; run one `novainfer serve` "
                         f"per replica behind a router (sglang-router, vllm-router, llm-d): see docs/DEPLOY.md")
    return dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks=args.num_gpu_blocks_override,
                enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
                async_scheduling=args.async_scheduling,
                dtype=args.dtype, device=args.device, tensor_parallel_size=args.tensor_parallel_size,
                quantization=args.quantization, cpu_kv_cache_tokens=args.cpu_kv_cache_tokens,
                cache_dtype=args.kv_cache_dtype,
                distributed_executor_backend=args.distributed_executor_backend,
                tensor_parallel_device_ids=args.tensor_parallel_device_ids, nnodes=args.nnodes,
                node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                fault_injection=args.fault_injection, load_format=args.load_format,
                trim_heap_when_idle=args.trim_heap_when_idle,
                speculative_config=args.speculative_config, kv_events_config=args.kv_events_config)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from novainfer import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    prompts = args.prompt or [sys.stdin.read()]
    for out in llm.generate(prompts, sampling_params(args), use_tqdm=False):
        print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Read a line, answer it with the whole conversation as context; an empty line or EOF quits."""
    from novainfer import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    params = sampling_params(args)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip() or line.strip() in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(reply, flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def add_server_args(p: argparse.ArgumentParser) -> None:
    """`vllm serve`'s server flags where they apply, plus NovaInfer's limits and sessions."""
    d = ServerConfig()
    p.add_argument("--model", dest="more_models", action="append", default=[],
                   help="another model to serve (repeatable); requests route by their `model` field")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="API names of the models, in order (default: the paths as given)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--api-key", default=d.api_key, help="require 'Authorization: Bearer <key>' (or "
                   "'x-api-key: <key>') on the API (visible in `ps`: prefer --api-key-file or the NOVAINFER_API_KEY "
                   "environment variable)")
    p.add_argument("--api-key-file", default=None, help="read the API key from the first line of this file")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the model decides, --tool-call-parser finds its calls')
    p.add_argument("--tool-call-parser", default=d.tool_call_parser, choices=["hermes", "llama3_json"],
                   help="the model's tool-call format: hermes (Qwen2.5, Qwen3), llama3_json (Llama 3.x)")
    p.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests)
    p.add_argument("--max-queue-len", type=int, default=d.max_queue_len,
                   help="requests allowed to wait for a slot; past it the server answers 429")
    p.add_argument("--max-sessions", type=int, default=d.max_sessions)
    p.add_argument("--session-ttl", type=float, default=d.session_ttl)
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="larger request bodies are refused with 413")
    p.add_argument("--allowed-origins", nargs="+", default=d.allowed_origins, metavar="ORIGIN",
                   help="origins allowed by CORS (e.g. http://localhost:3000 or *); CORS is off without it")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM, seconds in-flight requests may finish before they are aborted")
    p.add_argument("--drain-delay", type=float, default=d.drain_delay,
                   help="on SIGTERM, seconds /ready answers 503 (routers stop sending) before the drain starts")
    p.add_argument("--engine-core", choices=("process", "thread"), default="process",
                   help="process: each model's engine core runs in a process of its own (default); thread: in "
                        "a thread of the server's process, as before the split (for comparison)")


def cmd_serve(args: argparse.Namespace) -> int:
    """Load every model, then serve them over HTTP until interrupted."""
    from novainfer.config import EngineConfig
    from novainfer.loader.default_model import DEFAULT_MODEL_NAME
    from novainfer.server.api_server import RequestIdFilter, build_app
    from novainfer.server.async_llm import AsyncLLM
    from novainfer.server.launcher import run_server
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    paths = ([args.model] if args.model or not args.more_models else []) + args.more_models
    names = args.served_model_name or [p or DEFAULT_MODEL_NAME for p in paths]
    if len(names) != len(paths) or len(set(names)) != len(names):
        raise SystemExit(f"--served-model-name needs one distinct name per model: {len(paths)} models, names {names}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    config = ServerConfig(host=args.host, port=args.port,
                          api_key=ServerConfig.resolve_api_key(args.api_key, args.api_key_file),
                          enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                          max_concurrent_requests=args.max_concurrent_requests, max_queue_len=args.max_queue_len,
                          max_sessions=args.max_sessions, session_ttl=args.session_ttl,
                          max_request_body_bytes=args.max_request_body_bytes, allowed_origins=args.allowed_origins,
                          shutdown_timeout=args.shutdown_timeout, drain_delay=args.drain_delay)
    if args.engine_core == "process":  # this process never imports torch: the engine cores do
        engine_class = AsyncLLM
    else:
        from novainfer.engine.llm_engine import LLMEngine
        engine_class = LLMEngine
    engines = [(name, engine_class(EngineConfig.from_kwargs(path, **engine_kwargs(args))))
               for name, path in zip(names, paths)]
    app = build_app(engines, config)
    base = f"http://{args.host}:{args.port}"
    print(f"NovaInfer serving {', '.join(names)}\n  web page: {base}/\n  OpenAI API: {base}/v1  "
          f"(docs {base}/docs, metrics {base}/metrics)", flush=True)
    run_server(app, config, args.log_level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="novainfer", description="NovaInfer LLM inference engine")
    parser.add_argument("--log-level", default=None, help="default: INFO for serve, WARNING otherwise")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    add_engine_args(serve, model_positional=True)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="complete one or more prompts")
    gen.add_argument("prompt", nargs="*", help="prompt text (read from stdin when absent)")
    chat = sub.add_parser("chat", help="chat in the terminal with the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    for p in (gen, chat):
        add_engine_args(p, model_positional=False)
        add_sampling_args(p)
    gen.set_defaults(func=cmd_generate)
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.log_level = (args.log_level or ("INFO" if args.command == "serve" else "WARNING")).upper()
    fmt = "%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s" if args.command == "serve" \
        else "%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=args.log_level, format=fmt)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
