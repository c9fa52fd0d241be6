"""Memory: the front-end of `novainfer serve` never imports torch (nor triton, nor transformers'
config and model modules, which import torch): the engine core loads the model's config and tokenizer and
hands the tokenizer back. Checked on a real server with the default model: the front-end process maps no
torch or triton library after chat, plain and grammar-constrained requests, while its engine core does (so
the check can see them), and it tokenizes exactly as transformers' AutoTokenizer on the same file.
"""

import json
import os
import re
import subprocess
import sys

import httpx
import psutil
import pytest
import torch

from novainfer.config import EngineConfig
from novainfer.server.chat_utils import apply_chat_template
from novainfer.loader.default_model import DEFAULT_MODEL_NAME
from novainfer.loader.model_info import load_tokenizer, resolve_model_path
from tests.server_utils import ROOT, RemoteServer

TORCH_LIBS = re.compile(r"/(libtorch[^/]*\.so|libtriton[^/]*\.so|libc10[^/]*\.so)")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color, ünïcode ✓"}]


def _mapped_libs(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {m.group(1) for line in f if (m := TORCH_LIBS.search(line))}


def _python(code: str, **env: str) -> str:
    """Run code in a fresh interpreter with this checkout first on the path; its stdout."""
    full_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.pop("NOVAINFER_DEVICE", None)
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    ).stdout


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    srv = RemoteServer([], str(tmp_path_factory.mktemp("frontend") / "server.log"), timeout=240)
    yield srv
    srv.stop()


def test_frontend_maps_no_torch_while_serving(default_server):
    srv = default_server
    body = {"model": DEFAULT_MODEL_NAME, "max_tokens": 4, "temperature": 0}
    chat = httpx.post(srv.url + "/v1/chat/completions", json={**body, "messages": MESSAGES}, timeout=60)
    plain = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": "The sea is"}, timeout=60)
    choice = httpx.post(
        srv.url + "/v1/completions",
        timeout=120,
        json={**body, "prompt": "Pick one:", "structured_outputs": {"choice": ["red", "blue"]}},
    )
    assert chat.status_code == plain.status_code == choice.status_code == 200, (chat.text, plain.text, choice.text)
    assert choice.json()["choices"][0]["text"] in ("red", "blue")
    core = psutil.Process(srv.proc.pid).children()
    assert len(core) == 1
    assert _mapped_libs(srv.proc.pid) == set(), "the front-end process maps torch/triton libraries"
    assert psutil.Process(srv.proc.pid).memory_info().rss < 250 * 2**20  # ~120-160 MiB; 460 with torch
    assert any(lib.startswith("libtorch") for lib in _mapped_libs(core[0].pid))  # the check sees them where they are


def test_frontend_tokenizes_as_transformers(default_server):
    """The tokenizer the core sent over is transformers' own on the same file: same ids for a chat and a
    prompt, same text back."""
    reference = load_tokenizer(resolve_model_path(None))  # AutoTokenizer, in this (torch) process
    srv = default_server
    chat = httpx.post(srv.url + "/tokenize", json={"model": DEFAULT_MODEL_NAME, "messages": MESSAGES}).json()
    assert reference.chat_template  # the file's template, not the plain fallback
    assert chat["tokens"] == apply_chat_template(reference, MESSAGES, add_generation_prompt=True)
    text = "Héllo  wörld\n\tdone <|im_end|>"
    prompt = httpx.post(srv.url + "/tokenize", json={"model": DEFAULT_MODEL_NAME, "prompt": text}).json()
    assert prompt["tokens"] == reference.encode(text)
    back = httpx.post(srv.url + "/detokenize", json={"model": DEFAULT_MODEL_NAME, "tokens": prompt["tokens"]})
    assert back.json()["prompt"] == reference.decode(prompt["tokens"])


def test_server_modules_import_without_torch():
    """`import novainfer` and every module the serve command's front-end loads leave torch out; LLM still
    comes from the package (and brings torch when asked for)."""
    out = _python(
        "import sys, novainfer, novainfer.entrypoints.cli, novainfer.server.api_server\n"
        "import novainfer.server.async_llm, novainfer.server.launcher\n"
        "import novainfer.structured_output.guidance_backend\n"
        "print(sorted(m for m in ('torch', 'triton', 'transformers.configuration_utils')\n"
        "             if m in sys.modules))\n"
        "from novainfer import LLM\n"
        "print(LLM.__module__, 'torch' in sys.modules)"
    )
    assert out.splitlines() == ["[]", "novainfer.entrypoints.llm True"]


def test_may_use_cuda_answers_without_torch():
    """The core's start method is chosen without torch; 'auto' agrees with torch on this machine, and a named
    device (flag or NOVAINFER_DEVICE) answers by itself."""
    code = (
        "import sys\nfrom novainfer.config import EngineConfig\n"
        "print([EngineConfig.from_kwargs('m', device=d).may_use_cuda() for d in ('auto', 'cpu', 'cuda:1')], "
        "'torch' in sys.modules)"
    )
    assert _python(code).strip() == f"{[torch.cuda.is_available(), False, True]} False"
    assert _python(code, NOVAINFER_DEVICE="cuda").strip() == "[True, True, True] False"


def test_dtype_names_resolve_in_the_core():
    """from_kwargs keeps a checked dtype name (no torch in the front-end); torch_dtype gives the torch dtype."""
    names = {
        "float32": torch.float32,
        "float": torch.float32,
        "half": torch.float16,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "auto": None,
    }
    for name, want in names.items():
        mc = EngineConfig.from_kwargs("m", dtype=name).model_config
        assert mc.torch_dtype is want and (mc.dtype is None) == (want is None)
    assert EngineConfig.from_kwargs("m", dtype=torch.float16).model_config.torch_dtype is torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig.from_kwargs("m", dtype="float8")
    assert (
        json.loads(
            _python(
                "import json\nfrom novainfer.config import EngineConfig\n"
                "print(json.dumps(EngineConfig.from_kwargs('m', dtype='half').model_config.dtype))"
            )
        )
        == "float16"
    )


@pytest.mark.parametrize(
    "line, want",
    [("cuda: Optional[str] = '12.8'", True), ("cuda: Optional[str] = None", False), ("cuda = '11.8'", True)],
)
def test_cuda_build_read_from_torch_version_file(tmp_path, monkeypatch, line, want):
    """A CUDA build of torch is told from torch/version.py's text, as the wheels write it."""
    import importlib.util
    from types import SimpleNamespace

    from novainfer import platform

    (tmp_path / "version.py").write_text(f"__version__ = '2.13.0'\n{line}\nhip: Optional[str] = None\n")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    )
    assert platform.torch_has_cuda_build() is want
