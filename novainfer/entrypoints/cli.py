"""The `novainfer` command: serve (the OpenAI-compatible server), generate (prompts), chat (a terminal loop).

A user's mistake (a bad path, flag value or file, a busy port) ends the command with a one-line message on
stderr and exit code 1 (2 for a usage error); `--debug` or NOVAINFER_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from typing import NoReturn

import novainfer
from novainfer.config import ServerConfig
from novainfer.entrypoints.engine_args import add_engine_args, add_field_flags, engine_kwargs, field_values
from novainfer.sampling_params import SamplingParams

__all__ = ["add_engine_args", "build_parser", "engine_kwargs", "main"]


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


DEBUG_ENV = "NOVAINFER_DEBUG"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are two lines (the error, where help is), not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


def cmd_generate(args: argparse.Namespace) -> int:
    """Complete each prompt (one positional, or --prompt repeated, or stdin); several are labelled."""
    if args.extra_words:
        args.parser.error(
            f"generate takes one prompt, got {1 + len(args.extra_words)} words: quote the prompt "
            '("...") or give each prompt with --prompt'
        )
    prompts = args.prompts + ([args.prompt] if args.prompt is not None else [])
    if not prompts:
        prompts = [sys.stdin.read()]
    from novainfer import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    outputs = llm.generate(prompts, sampling_params(args), use_tqdm=False)
    for i, out in enumerate(outputs, 1):
        if len(outputs) > 1:
            print(f"--- [{i}/{len(outputs)}] {_shorten(out.prompt)}")
        print(out.outputs[0].text, flush=True)
    return 0


def _shorten(text: str, width: int = 60) -> str:
    """A prompt on one line, cut to width characters."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 3] + "..."


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
    p.add_argument(
        "--model",
        dest="more_models",
        action="append",
        default=[],
        help="another model to serve (repeatable); requests route by their `model` field",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="API names of the models, in order (default: the paths as given)",
    )
    p.add_argument("--api-key-file", default=None, help="read the API key from the first line of this file")
    add_field_flags(p.add_argument_group("server", "the HTTP server's settings"), dataclasses.fields(ServerConfig))


def check_parsers(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Refuse a parser name the server does not have, before any model loads."""
    from novainfer.server.reasoning_parsers import REASONING_PARSERS
    from novainfer.server.tool_parsers import TOOL_PARSERS

    for flag, name, known in (
        ("--tool-call-parser", tool_call_parser, TOOL_PARSERS),
        ("--reasoning-parser", reasoning_parser, REASONING_PARSERS),
    ):
        if name is not None and name not in known:
            raise ValueError(f"{flag} {name!r} is not one of {', '.join(sorted(known))}")


def cmd_serve(args: argparse.Namespace) -> int:
    """Load every model, then serve them over HTTP until interrupted."""
    from novainfer.config import EngineConfig
    from novainfer.loader.default_model import DEFAULT_MODEL_NAME
    from novainfer.server.async_llm import AsyncLLM
    from novainfer.server.request_context import RequestIdFilter

    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    paths = ([args.model] if args.model or not args.more_models else []) + args.more_models
    names = args.served_model_name or [p or DEFAULT_MODEL_NAME for p in paths]
    if len(names) != len(paths) or len(set(names)) != len(names):
        raise ValueError(f"--served-model-name needs one distinct name per model: {len(paths)} models, names {names}")
    check_parsers(args.tool_call_parser, args.reasoning_parser)
    config = dataclasses.replace(
        ServerConfig(**field_values(ServerConfig, args)),
        api_key=ServerConfig.resolve_api_key(args.api_key, args.api_key_file),
    )
    _check_port_free(args.host, args.port)  # before minutes of loading, not after
    # this process never imports torch: each model's engine core, a process of its own, does; while the first
    # loads, this one imports the app (FastAPI and the routes: ~1 s)
    app_modules = ("novainfer.server.api_server", "novainfer.server.launcher")
    engines = [
        (name, AsyncLLM(EngineConfig.from_kwargs(path, **engine_kwargs(args)), import_while_loading=app_modules))
        for name, path in zip(names, paths)
    ]
    from novainfer.server.api_server import build_app
    from novainfer.server.launcher import run_server

    app = build_app(engines, config)
    base = f"http://{args.host}:{args.port}"
    print(
        f"NovaInfer serving {', '.join(names)}\n  web page: {base}/\n  OpenAI API: {base}/v1  "
        f"(schema {base}/openapi.json, metrics {base}/metrics)",
        flush=True,
    )
    return run_server(app, config, args.log_level)


def _check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on, naming it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror} (choose another with --port)") from None


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="novainfer", description="NovaInfer LLM inference engine")
    parser.add_argument("-V", "--version", action="version", version=f"novainfer {novainfer.__version__}")
    parser.add_argument("--log-level", default=None, help="default: INFO for serve, WARNING otherwise")
    parser.add_argument(
        "--debug", action="store_true", default=False, help=f"show the traceback of an error (as {DEBUG_ENV}=1 does)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    add_engine_args(serve, model_positional=True)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="complete one or more prompts")
    gen.add_argument(
        "prompt", nargs="?", default=None, help="the prompt, quoted (read from stdin when no prompt is given)"
    )
    gen.add_argument(
        "--prompt",
        dest="prompts",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt; repeat for several, completed as one batch",
    )
    gen.add_argument("extra_words", nargs="*", help=argparse.SUPPRESS)
    chat = sub.add_parser("chat", help="chat in the terminal with the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    for p in (gen, chat):
        add_engine_args(p, model_positional=False)
        add_sampling_args(p)
    gen.set_defaults(func=cmd_generate, parser=gen)
    chat.set_defaults(func=cmd_chat)
    for p in (serve, gen, chat):  # also after the subcommand; SUPPRESS keeps the top level's value otherwise
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.log_level = (args.log_level or ("INFO" if args.command == "serve" else "WARNING")).upper()
    fmt = (
        "%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"
        if args.command == "serve"
        else "%(levelname)s %(name)s: %(message)s"
    )
    logging.basicConfig(level=args.log_level, format=fmt)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # the engine core process, a child, reads it too
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if os.environ.get(DEBUG_ENV):
            raise
        from novainfer.engine.core_client import EngineCoreStartError  # its message is the core's error

        user_error = (ValueError, OSError, NotImplementedError, EngineCoreStartError)
        message = str(e) if isinstance(e, user_error) and str(e) else f"{type(e).__name__}: {e}"
        print(f"novainfer {args.command}: error: {message}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
