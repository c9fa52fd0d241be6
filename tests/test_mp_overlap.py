"""Async scheduling over the mp executor (tp=2, gloo processes on the CPU): the workers pipeline steps, and
greedy output is token-identical to tp=1's synchronous loop and to the mp synchronous loop, with sequences
ending at different steps (max_tokens, a stop token, an abort); a dead worker or a failing step is named,
and no process is left."""

import os
import signal
import threading
import time

import pytest

from novainfer import LLM, SamplingParams
from novainfer.config import EngineConfig
from novainfer.engine.llm_engine import LLMEngine
from novainfer.executor.multiproc import RemoteStep
from novainfer.executor.step_pipeline import StepPipeline
from tests import faults
from tests.tiny_models import make_tiny_model

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. The capital of France is",
    "def add(a, b):",
    "Paged attention stores keys and values in fixed-size blocks",
]
MAX_TOKENS = [20, 7, 13, 16]
# chunked prefill, mixed prefill/decode steps, and a KV cache small enough that sequences are preempted
ENGINE = dict(block_size=4, max_num_batched_tokens=16, dtype="float32", cpu_kv_cache_tokens=96)
MP = dict(tensor_parallel_size=2, distributed_executor_backend="mp", master_port=0)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    """8 heads / 4 KV heads: splits over 2 ranks."""
    return make_tiny_model(
        str(tmp_path_factory.mktemp("qwen2_tp_overlap")), "qwen2", seed=5, num_heads=8, num_kv_heads=4, head_dim=8
    )


@pytest.fixture(scope="module")
def tp1(tp_model):
    return LLM(tp_model, async_scheduling=False, **ENGINE)


@pytest.fixture(scope="module")
def mp_overlap(tp_model):
    """tp=2 over mp with the overlapped loop; the module's last test kills one of its workers."""
    llm = LLM(tp_model, async_scheduling=True, **MP, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()
    assert not any(p.is_alive() for p in llm.llm_engine.executor.procs)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def scenario(engine: LLMEngine, stop_token: int, between_steps=None) -> dict:
    """Four requests stepped by hand: different max_tokens, one with a stop token, one aborted midway."""
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        engine.add_request(str(i), prompt, greedy(n, stop_token_ids=[stop_token] if i == 3 else None))
    finished = {}
    for n in range(80):
        if n == 6:
            assert engine.abort_request("0").outputs[0].finish_reason == "abort"
        if between_steps is not None and n in (3, 9):
            between_steps()
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                finished[out.request_id] = (c.token_ids, c.finish_reason, c.stop_reason)
        if not engine.engine_core.has_unfinished_requests():
            break
    assert sorted(finished) == ["1", "2", "3"] and engine.block_manager.num_free_blocks == engine.engine_core.num_blocks
    return finished


@pytest.mark.timeout(120)
def test_overlapped_mp_matches_tp1_and_the_sync_loop(tp1, mp_overlap):
    core = mp_overlap.llm_engine.engine_core
    assert core.async_scheduling and not tp1.llm_engine.engine_core.async_scheduling
    params = [greedy(n) for n in MAX_TOKENS]
    want = [o.outputs[0].token_ids for o in tp1.generate(PROMPTS, params, use_tqdm=False)]
    assert [len(t) for t in want] == MAX_TOKENS
    assert [o.outputs[0].token_ids for o in mp_overlap.generate(PROMPTS, params, use_tqdm=False)] == want
    assert core.scheduler.num_preemptions > 0

    stop_token = want[3][4]  # the stop token ends request 3 at or before its 5th token
    executor = mp_overlap.llm_engine.executor
    profiles = []

    def check_health_between_steps():  # a call between steps reads the step replies first, not as its own
        inflight = core._inflight.handle
        assert isinstance(inflight, RemoteStep) and not inflight.done  # launched, its reply not read yet
        executor.check_health()
        assert inflight.done
        profiles.append(executor.collective_rpc("profile"))

    ref = scenario(tp1.llm_engine, stop_token)
    assert ref["3"][1:] == ("stop", stop_token) and [len(ref[k][0]) for k in "12"] == MAX_TOKENS[1:3]
    assert scenario(mp_overlap.llm_engine, stop_token, check_health_between_steps) == ref
    assert [[r["rank"] for r in p] for p in profiles] == [[0, 1], [0, 1]]
    # seeded sampling: each rank samples for itself and feeds its own token to the next step, so the overlapped
    # loop matches the synchronous one (where every rank gets rank 0's tokens) only if the ranks agree
    sampled = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(MAX_TOKENS)
    ]
    sampled[2] = SamplingParams(temperature=0.8, seed=3, max_tokens=13, presence_penalty=0.5, ignore_eos=True)
    overlapped = [o.outputs[0].token_ids for o in mp_overlap.generate(PROMPTS, sampled, use_tqdm=False)]
    core.async_scheduling = False  # the same workers, the synchronous loop (execute_model)
    try:
        assert scenario(mp_overlap.llm_engine, stop_token) == ref
        assert [o.outputs[0].token_ids for o in mp_overlap.generate(PROMPTS, sampled, use_tqdm=False)] == overlapped
    finally:
        core.async_scheduling = True


@pytest.mark.parametrize("which", ["tp1", "mp_overlap"])
def test_request_fault_fails_it_alone(request, tp1, which, monkeypatch):
    """A fault while applying one request's token (the engine core's "postprocess" stage) fails that request
    alone; the others decode on and finish with tp=1's tokens, with the overlap's extra token dropped."""
    engine = request.getfixturevalue(which).llm_engine
    core = engine.engine_core
    want = [o.outputs[0].token_ids for o in tp1.generate(PROMPTS[:3], greedy(12), use_tqdm=False)]
    with monkeypatch.context() as patch:
        faults.install("postprocess:bad-", patch.setattr)
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"ok-{i}", prompt, greedy(12))
        engine.step()
        engine.step()
        engine.add_request("bad-1", PROMPTS[3], greedy(12))
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0]
    assert outs["bad-1"].finish_reason == "error"
    assert [outs[f"ok-{i}"].token_ids for i in range(3)] == want
    while core.has_unfinished_requests():  # the step still in flight: nothing comes of it
        core.step()
    assert engine.block_manager.num_free_blocks == core.num_blocks


@pytest.mark.timeout(120)
def test_a_failing_step_stops_the_workers_and_names_the_rank(tp_model, monkeypatch):
    """As with the synchronous mp loop (docs/RELIABILITY.md): a step that raises in the workers stops them; the
    step's requests fail and the error names the rank; nothing hangs or is left running."""
    engine = LLMEngine(EngineConfig.from_kwargs(tp_model, async_scheduling=True, **MP, **ENGINE))
    executor = engine.executor
    pack, broken = executor.packer.pack, []

    def pack_one_broken(sched):  # a step naming a sequence the workers never saw: every rank raises unpacking it
        msg = pack(sched)
        if engine.engine_core.step_id == 5:
            msg.rows.append((10**9, 0, 1, True, [1], [0], []))
            broken.append(msg)
        return msg

    monkeypatch.setattr(executor.packer, "pack", pack_one_broken)
    try:
        for i in range(3):
            engine.add_request(f"ok-{i}", PROMPTS[i], greedy(12))
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank=\d.*(failed in execute_step|died)"):
            for _ in range(20):
                engine.step()
        assert broken and not any(p.is_alive() for p in executor.procs)
        assert not engine.has_unfinished_requests()  # the failed step's requests were failed, not left hanging
        with pytest.raises(RuntimeError, match="shut down"):
            executor.check_health()
    finally:
        t0 = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - t0 < 10
    assert not any(p.is_alive() for p in executor.procs)


def test_collective_rpc_takes_a_function(tp1, mp_overlap):
    """fn(worker, *args) on every rank (vLLM's form); with mp it is pickled by name (a builtin here, so the
    workers import nothing)."""
    assert tp1.llm_engine.executor.collective_rpc(getattr, "rank") == [0]
    assert mp_overlap.llm_engine.executor.collective_rpc(getattr, "rank") == [0, 1]
    assert mp_overlap.llm_engine.executor.collective_rpc(getattr, "is_driver_worker") == [True, False]


def kill_mid_generation(engine: LLMEngine, rank: int) -> None:
    """SIGKILL one rank while a step is in flight: the next steps raise naming it, and no process is left."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"kill-{i}", prompt, greedy(40))
    for _ in range(5):
        engine.step()
    assert engine.engine_core._inflight is not None  # a step is running on the workers
    victim = engine.executor.procs[rank]
    if rank == 0:  # stopped first, so a step the driver sends lies unread in its pipe: the kill resets it
        os.kill(victim.pid, signal.SIGSTOP)
        threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL)).start()
    else:
        os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"worker rank={rank} \(pid {victim.pid}\) died"):
        for _ in range(40):
            engine.step()
    assert not any(p.is_alive() for p in engine.executor.procs)


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_generation_is_named(mp_overlap):
    """The last test that uses mp_overlap: it stops its workers."""
    kill_mid_generation(mp_overlap.llm_engine, 1)


@pytest.mark.timeout(120)
def test_rank0_killed_mid_generation_is_named(tp_model):
    """Rank 0 holds the driver's pipe: its death reads as EOF or a reset connection, and is named too."""
    engine = LLMEngine(EngineConfig.from_kwargs(tp_model, async_scheduling=True, **MP, **ENGINE))
    try:
        kill_mid_generation(engine, 0)
    finally:
        engine.shutdown()


class HeldStep:
    """A launched step whose read-back waits for its gate."""

    def __init__(self, i: int, gate: threading.Event):
        self.i, self.gate = i, gate

    def get(self) -> str:
        assert self.gate.wait(10)
        return f"output {self.i}"


def test_step_pipeline_answers_in_order_and_keeps_two_steps_in_flight():
    """The worker side alone: replies in launch order, a failed launch answered in its turn, and a third
    launch waits until the first step is read back (its host buffers are the third's)."""
    sent: list = []
    pipeline = StepPipeline(0, sent.append)
    gates = [threading.Event() for _ in range(3)]
    try:
        pipeline.launch(lambda: HeldStep(0, gates[0]))
        pipeline.launch(lambda: HeldStep(1, gates[1]))
        third = threading.Thread(target=pipeline.launch, args=(lambda: HeldStep(2, gates[2]),))
        third.start()
        third.join(0.3)
        assert third.is_alive() and sent == []  # two in flight, nothing read back yet
        gates[1].set()
        third.join(0.3)
        assert third.is_alive() and sent == []  # step 1 is done, but replies go in order: 0 first
        gates[0].set()
        third.join(10)
        assert not third.is_alive()
        gates[2].set()
        pipeline.launch(lambda: 1 / 0)  # a launch that raises: its reply says so, in its turn
        pipeline.drain()
        assert [r[0][:2] for r in sent] == [(0, True)] * 3 + [(0, False)]
        assert [r[0][2] for r in sent[:3]] == ["output 0", "output 1", "output 2"]
        assert "ZeroDivisionError" in sent[3][0][2]
    finally:
        for g in gates:
            g.set()
        pipeline.close()


@pytest.mark.parametrize(
    "kwargs, want",
    [
        (dict(distributed_executor_backend="mp", tensor_parallel_size=2, device="cuda"), True),  # the tp=2 bench line
        (dict(distributed_executor_backend="mp", tensor_parallel_size=2, nnodes=2, device="cuda"), True),
        (dict(distributed_executor_backend="mp", tensor_parallel_size=2, device="cpu"), False),  # off on the CPU...
        (dict(distributed_executor_backend="mp", tensor_parallel_size=2, device="cpu", async_scheduling=True), True),
        (dict(distributed_executor_backend="uni", tensor_parallel_size=1, device="cuda"), True),
        (dict(distributed_executor_backend="uni", tensor_parallel_size=2, device="cuda"), False),  # threads: no overlap
        (dict(distributed_executor_backend="uni", tensor_parallel_size=2, device="cpu", async_scheduling=True), False),
    ],
)
def test_which_executors_overlap_by_default(kwargs, want):
    assert EngineConfig.from_kwargs("unused", **kwargs).use_async_scheduling() is want
