"""launch_or_fallback: a launch this GPU lacks the shared memory for falls back once and is remembered, and the
failing launches' frames are not kept alive by the error Triton caches (the 12 GiB a Qwen3.5-9B prefill step kept)."""

import gc
import weakref

import triton

from novainfer.kernels import tiling


class _Scratch:
    """Stands for the tensors a kernel wrapper's frame holds (a DeltaNet layer's float32 scratch)."""


def _triton_36_kernel():
    """A launch the way Triton 3.6's cached kernel behaves on a shared-memory overflow: the same error object is
    raised at every launch of the failing choice."""
    err = triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")
    calls = []

    def launch(stages: int, *args) -> None:
        calls.append(stages)
        if stages == 3:
            raise err

    return launch, calls, err


def _layer(kernel, key, alive: list) -> None:
    """A kernel wrapper: its launch closure holds the layer's scratch, as the DeltaNet scan's holds its arguments."""
    scratch = _Scratch()
    alive.append(weakref.ref(scratch))

    def launch(stages: int) -> None:
        kernel(stages, scratch)

    tiling.launch_or_fallback(launch, 3, 1, key=key)


def test_fallback_is_remembered_and_frees_the_failing_frames():
    launch, calls, err = _triton_36_kernel()
    key = ("test", object())
    alive: list = []
    assert tiling.fits(key)
    for _ in range(4):
        _layer(launch, key, alive)
    gc.collect()
    assert calls == [3, 1, 1, 1, 1], "the failing choice is tried once, then the fallback goes straight through"
    assert not tiling.fits(key)
    assert err.__traceback__ is None
    assert [r() for r in alive] == [None] * 4, "a frame of a launch that raised is still alive"


def test_a_choice_that_fits_is_launched_as_asked():
    calls = []
    key = ("test", object())
    tiling.launch_or_fallback(calls.append, 3, 1, key=key)
    tiling.launch_or_fallback(calls.append, 3, 1, key=key)
    assert calls == [3, 3] and tiling.fits(key)


def test_other_errors_propagate():
    def launch(stages: int) -> None:
        raise ValueError("not a resource error")

    key = ("test", object())
    try:
        tiling.launch_or_fallback(launch, 3, 1, key=key)
    except ValueError:
        pass
    else:
        raise AssertionError("a non-resource error was swallowed")
    assert tiling.fits(key)
