import os

import pytest
import torch
from hypothesis import settings

# Without a GPU, Triton kernels run in Triton's CPU interpreter (set before anything imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import patch_once_per_launch

    patch_once_per_launch()

from novainfer.config import EngineConfig  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="module", params=["sync", "overlap"])
def step_loop(request):
    """The step loop of the engines a module builds: synchronous, or async scheduling (plan step N+1 while
    step N runs). A module that uses this fixture runs once with each."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineConfig, "use_async_scheduling", lambda self: request.param == "overlap")
        yield request.param


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, which only contend on the shared machine: a module opts in
    with pytestmark = pytest.mark.usefixtures("one_thread")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2")), "qwen2", tie=False)


@pytest.fixture(scope="session")
def tiny_qwen2_tied(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2_tied")), "qwen2", tie=True, seed=1)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "llama", seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3", seed=3)


# Hypothesis profiles: `make test` runs the bounded one (a few hundred schema-fuzzing requests, about a
# minute on two cores); `make fuzz` passes --hypothesis-profile=fuzz, which the plugin loads after this.
settings.register_profile("bounded", max_examples=60, deadline=None, print_blob=True)
settings.register_profile("fuzz", max_examples=1000, deadline=None, print_blob=True)
settings.load_profile("bounded")
