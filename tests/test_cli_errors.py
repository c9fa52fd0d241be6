"""The command line's user errors: one clear message on stderr (two for a usage error), a non-zero exit, no
traceback unless --debug or NOVAINFER_DEBUG=1; and the offline API's refusals name the field or architecture."""

import concurrent.futures
import os
import socket
import subprocess
import sys

import pytest

from novainfer import LLM, SamplingParams
from tests.server_utils import ROOT

GPT2_CONFIG = (
    '{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32, "n_head": 2, '
    '"n_layer": 1, "vocab_size": 100, "bos_token_id": 0, "eos_token_id": 0}'
)


def cli(*args: str, env: dict | None = None, stdin: str = "") -> subprocess.CompletedProcess:
    """`novainfer ARGS` as a subprocess on the CPU."""
    full = {k: v for k, v in os.environ.items() if k != "NOVAINFER_DEBUG"}
    full.update(NOVAINFER_DEVICE="cpu", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "novainfer.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=full,
        input=stdin,
    )


def cli_together(*runs: tuple[tuple[str, ...], str]) -> list[subprocess.CompletedProcess]:
    """cli(*args, stdin=stdin) for each (args, stdin), the processes running side by side (each start is seconds
    of imports on one core)."""
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: cli(*run[0], stdin=run[1]), runs))


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """stderr's lines, less the log records of a server's start (they begin with the date)."""
    return [line for line in proc.stderr.splitlines() if not line[:4].isdigit()]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gpt2")
    (path / "config.json").write_text(GPT2_CONFIG)
    return str(path)


@pytest.fixture(scope="module")
def corrupt_gguf(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gguf") / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 12)  # a version, then a truncated header
    return str(path)


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["serve", "/no/such/model"], 1, "novainfer serve: error: model path '/no/such/model' does not exist"),
        (["generate", "--max-num-seqs", "0", "hi"], 1, "novainfer generate: error: max_num_seqs must be >= 1, got 0"),
        (["serve", "--max-num-seqs", "lots"], 2, "novainfer serve: error: argument --max-num-seqs: invalid int value"),
        (
            ["serve", "--distributed-executor-backend", "ray"],
            2,
            "novainfer serve: error: argument "
            "--distributed-executor-backend: distributed_executor_backend='ray' is not implemented; use 'uni'",
        ),
        (
            ["generate", "--dtype", "float8", "hi"],
            2,
            "novainfer generate: error: argument --dtype: invalid choice: 'float8'",
        ),
        (
            ["generate", "The", "capital", "of"],
            2,
            "novainfer generate: error: generate takes one prompt, got 3 words: quote the prompt",
        ),
    ],
)
def test_user_errors_are_one_message(args, code, message):
    proc = cli(*args)
    lines = error_lines(proc)
    assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == (2 if code == 2 else 1) and lines[0].startswith(message), proc.stderr
    if code == 2:
        assert lines[1] == f"(`novainfer {args[0]} --help` lists the options)"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_model_files_are_one_message(command, corrupt_gguf, gpt2):
    """generate fails in this process, serve in its engine core process: the same one line either way."""
    cases = (
        (corrupt_gguf, f"GGUF file {corrupt_gguf} is corrupt or truncated"),
        (gpt2, "unsupported model architecture ['GPT2LMHeadModel']"),
    )
    procs = cli_together(
        *(
            ((command, *(["--model", path, "hi"] if command == "generate" else [path, "--port", "0"])), "")
            for path, _ in cases
        )
    )
    for (path, message), proc in zip(cases, procs):
        lines = error_lines(proc)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert len(lines) == 1 and lines[0].startswith(f"novainfer {command}: error: {message}"), proc.stderr


def test_port_in_use_is_one_message_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = cli("serve", "/no/such/model", "--port", str(port))  # the port is checked before the model
    assert proc.returncode == 1 and error_lines(proc) == [
        f"novainfer serve: error: cannot listen on 127.0.0.1:{port}: Address already in use (choose another "
        "with --port)"
    ], proc.stderr


@pytest.mark.parametrize("how", [["--debug"], ["serve", "--debug"], "env"])
def test_debug_shows_the_traceback(how):
    args = ["serve", "/no/such/model"]
    if how == "env":
        proc = cli(*args, env={"NOVAINFER_DEBUG": "1"})
    else:
        proc = cli(*(how + args[1:] if how[0] == "serve" else how + args))
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and proc.stderr.rstrip().endswith("no model hub is used)")


def test_version():
    import novainfer

    for flag in ("--version", "-V"):
        proc = cli(flag)
        assert proc.returncode == 0 and proc.stdout == f"novainfer {novainfer.__version__}\n"


def test_generate_prompts_one_per_option_labelled(tiny_qwen2):
    prompts = ["The cat sat on", "Hello, my name is"]
    flags = ["--model", tiny_qwen2, "--dtype", "float32", "--max-tokens", "6", "--temperature", "0"]
    several, one, piped = cli_together(
        (("generate", *flags, "--prompt", prompts[0], "--prompt", prompts[1]), ""),
        (("generate", *flags, prompts[1]), ""),
        (("generate", *flags), prompts[1]),
    )
    llm = LLM(tiny_qwen2, dtype="float32", device="cpu")
    texts = [
        o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    ]
    assert several.returncode == 0, several.stderr
    assert several.stdout == f"--- [1/2] {prompts[0]}\n{texts[0]}\n--- [2/2] {prompts[1]}\n{texts[1]}\n"
    assert one.stdout == piped.stdout == f"{texts[1]}\n"


def test_llm_refusals_name_the_field_or_architecture(gpt2):
    with pytest.raises(ValueError, match="quantization='fp8' quantizes a bf16/fp16 checkpoint.*GGUF"):
        LLM(quantization="fp8")  # the default model is a GGUF file
    with pytest.raises(ValueError, match=r"unsupported model architecture \['GPT2LMHeadModel'\]"):
        LLM(gpt2, quantization="fp8", device="cpu")
    with pytest.raises(NotImplementedError, match="distributed_executor_backend='ray' is not implemented"):
        LLM(gpt2, distributed_executor_backend="ray")


MP_SCRIPT = """
import sys
from novainfer import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="mp", master_port=0,
              dtype="float32", device="cpu")
    print(llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids)
"""


def test_mp_tensor_parallel_llm_exits_silently(tiny_qwen2, tmp_path):
    """An mp LLM left alive at exit stops its ranks cleanly: no worker traceback, no leaked semaphore."""
    script = tmp_path / "mp_llm.py"
    script.write_text(MP_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), tiny_qwen2],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[") and "Traceback" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
