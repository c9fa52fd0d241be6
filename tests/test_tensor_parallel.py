"""Tensor parallelism on the CPU: tp 2 and 4 give tp 1's greedy tokens (and transformers'), under uni (threads)
and mp (gloo processes, also as two "nodes" on loopback); sharding, all-reduce count and start-up checks."""

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from novainfer import LLM, SamplingParams
from novainfer.config import ParallelConfig, normalize_parallel_config
from novainfer.distributed import ShardError, TPGroup, set_tp_group
from novainfer.distributed.parallel_state import ThreadGroup
from novainfer.entrypoints.cli import build_parser, engine_kwargs, main
from novainfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tests.tiny_models import hf_greedy, make_tiny_model

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. The capital of France is",
    "def add(a, b):",
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
ENGINE = dict(
    block_size=4, max_num_batched_tokens=16, dtype="float32"
)  # chunked prefill and mixed prefill/decode steps


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    """8 heads / 4 KV heads (head_dim 8), intermediate 128: splits over 1, 2 and 4 ranks."""
    return make_tiny_model(
        str(tmp_path_factory.mktemp("qwen2_tp")), "qwen2", seed=5, num_heads=8, num_kv_heads=4, head_dim=8
    )


@pytest.fixture(scope="module")
def reference(tp_model):
    """tp_size 1 tokens, checked against transformers once."""
    llm = LLM(tp_model, **ENGINE)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    tok = llm.get_tokenizer()
    assert outs == [hf_greedy(tp_model, tok.encode(p), GREEDY.max_tokens) for p in PROMPTS]
    return outs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


# ---- configuration ------------------------------------------------------------------------------
def test_normalize_fills_derived_fields():
    cfg = normalize_parallel_config(
        ParallelConfig(tensor_parallel_size=4, distributed_executor_backend="mp", nnodes=2, node_rank=1)
    )
    assert (cfg.world_size, cfg.ranks_per_node, cfg.rank, cfg.tensor_parallel_device_ids) == (4, 2, 2, [0, 1])
    assert not cfg.use_single_process_tp and cfg.distributed_init_method == "tcp://127.0.0.1:29501"
    assert normalize_parallel_config(ParallelConfig(tensor_parallel_size=2)).use_single_process_tp


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(distributed_executor_backend="ray"), NotImplementedError, "distributed_executor_backend='ray'"),
        (dict(distributed_executor_backend="spark"), ValueError, "distributed_executor_backend.*'spark'"),
        (
            dict(tensor_parallel_size=2, tensor_parallel_device_ids=[1, 1]),
            ValueError,
            r"tensor_parallel_device_ids=\[1, 1\] contains duplicates",
        ),
        (
            dict(tensor_parallel_size=2, tensor_parallel_device_ids=[0]),
            ValueError,
            r"tensor_parallel_device_ids=\[0\] has length 1, expected 2",
        ),
        (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size must be >= 1, got 0"),
        (dict(tensor_parallel_size=2, nnodes=2), ValueError, "nnodes=2 needs distributed_executor_backend='mp'"),
        (dict(tensor_parallel_size=3, nnodes=2, distributed_executor_backend="mp"), ValueError, "nnodes=2"),
        (
            dict(tensor_parallel_size=2, nnodes=2, node_rank=2, distributed_executor_backend="mp"),
            ValueError,
            r"node_rank must be in \[0, nnodes=2\), got 2",
        ),
        (
            dict(tensor_parallel_size=2, nnodes=2, master_port=0, distributed_executor_backend="mp"),
            ValueError,
            r"master_port must be in 1..65535 \(0: a free port, one node only\), got 0",
        ),
    ],
)
def test_invalid_parallel_config_fails_at_start(tiny_qwen2, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        normalize_parallel_config(ParallelConfig(**kwargs))
    with pytest.raises(exc, match=message):
        LLM(tiny_qwen2, **kwargs)


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_kv_heads_must_split_evenly(tiny_qwen2, tmp_path, backend):
    with pytest.raises(ValueError, match="tp_size=4 tp_rank=0 global_nkvh=2 local_nkvh=0.5 device_id=cpu"):
        LLM(tiny_qwen2, tensor_parallel_size=4, distributed_executor_backend=backend, master_port=free_port())
    three = make_tiny_model(str(tmp_path / "kv3"), "qwen2", num_heads=6, num_kv_heads=3, layers=1)
    with pytest.raises(ValueError, match="tp_size=2 tp_rank=0 global_nkvh=3 local_nkvh=1.5 device_id=cpu"):
        LLM(three, tensor_parallel_size=2, distributed_executor_backend=backend, master_port=free_port())


def test_bad_weight_shape_names_the_weight(tp_model, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(tp_model):
        if not name.endswith(".safetensors"):
            (bad / name).write_bytes(open(os.path.join(tp_model, name), "rb").read())
    weights = load_file(os.path.join(tp_model, "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(136, 64)  # intermediate_size is 128
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ShardError,
        match=r"weight_name=model.layers.1.mlp.up_proj.weight global_shape=\(136, 64\) "
        r"local_shape=\(64, 64\) tp_size=2 tp_rank=\d",
    ):
        LLM(str(bad), tensor_parallel_size=2)


def test_cli_flags_reach_the_engine(tp_model, capsys):
    for argv in (
        ["serve", "m", "-tp", "2", "--distributed-executor-backend", "mp"],
        ["generate", "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "hi"],
    ):
        kw = engine_kwargs(build_parser().parse_args(argv))
        assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    texts = []
    for tp in ("1", "2"):
        assert main(["generate", "--model", tp_model, "-tp", tp, "--max-tokens", "12", "Hello, my name is"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()


# ---- sharding -----------------------------------------------------------------------------------
def test_shards_are_complementary_and_disjoint():
    """Traceable weights (arange): each rank holds its contiguous chunk; together exactly the whole."""
    hs, hd, nh, nkvh, di, tp = 8, 2, 4, 2, 6, 2
    q = torch.arange(nh * hd * hs, dtype=torch.float32).view(nh * hd, hs)
    k, v = q[: nkvh * hd] + 1000, q[: nkvh * hd] + 2000
    o = torch.arange(hs * nh * hd, dtype=torch.float32).view(hs, nh * hd) + 3000
    gate = torch.arange(di * hs, dtype=torch.float32).view(di, hs) + 4000
    up, down = gate + 1000, gate.t().contiguous() + 2000  # down: [hs, di]
    parts = {name: [] for name in ("q", "k", "v", "o", "gate", "up", "down")}
    try:
        for rank in range(tp):
            set_tp_group(TPGroup(rank, tp))
            qkv = QKVParallelLinear(hs, hd, nh, nkvh)
            gate_up = MergedColumnParallelLinear(hs, [di, di])
            o_proj, down_proj = RowParallelLinear(nh * hd, hs), RowParallelLinear(di, hs)
            for shard, w in (("q", q), ("k", k), ("v", v)):
                qkv.weight_loader(qkv.weight, w, shard)
            gate_up.weight_loader(gate_up.weight, gate, 0)
            gate_up.weight_loader(gate_up.weight, up, 1)
            o_proj.weight_loader(o_proj.weight, o)
            down_proj.weight_loader(down_proj.weight, down)
            lq, lkv = nh // tp * hd, nkvh // tp * hd
            assert qkv.weight.shape == (lq + 2 * lkv, hs) and o_proj.weight.shape == (hs, lq)
            got_q, got_k, got_v = qkv.weight.split([lq, lkv, lkv])
            assert torch.equal(got_q, q[rank * lq : (rank + 1) * lq])  # contiguous chunk, not interleaved
            parts["q"].append(got_q), parts["k"].append(got_k), parts["v"].append(got_v)
            parts["gate"].append(gate_up.weight[: di // tp]), parts["up"].append(gate_up.weight[di // tp :])
            parts["o"].append(o_proj.weight), parts["down"].append(down_proj.weight)
    finally:
        set_tp_group(TPGroup())
    for name, full, dim in (
        ("q", q, 0),
        ("k", k, 0),
        ("v", v, 0),
        ("gate", gate, 0),
        ("up", up, 0),
        ("o", o, 1),
        ("down", down, 1),
    ):
        assert torch.equal(torch.cat(parts[name], dim), full), name
        values = [set(p.flatten().tolist()) for p in parts[name]]
        assert not values[0] & values[1], name


def test_thread_group_sums_in_rank_order_and_names_a_broken_collective():
    import threading

    from novainfer.distributed.parallel_state import InProcessReducer

    reducer, out = InProcessReducer(3, timeout=30), {}
    groups = [ThreadGroup(r, 3, reducer) for r in range(3)]
    threads = [
        threading.Thread(target=lambda g=g: out.__setitem__(g.rank, g.all_reduce(torch.full((2,), g.rank + 1.0))))
        for g in groups
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(torch.equal(out[r], torch.full((2,), 6.0)) for r in range(3))
    reducer.barrier.abort()
    with pytest.raises(threading.BrokenBarrierError) as info:
        groups[0].all_reduce(torch.zeros(2))
    assert info.value.__notes__ == ["all_reduce failed: group=uni-threads rank=0/3 device=cpu"]


def test_two_all_reduces_per_layer_and_none_at_tp1(tp_model, monkeypatch):
    calls: dict[str, list[int]] = {"tp1": [], "tp2": []}
    thread_reduce = ThreadGroup.all_reduce
    monkeypatch.setattr(TPGroup, "all_reduce", lambda self, x: calls["tp1"].append(self.rank) or x)
    monkeypatch.setattr(
        ThreadGroup, "all_reduce", lambda self, x: calls["tp2"].append(self.rank) or thread_reduce(self, x)
    )
    one_step = SamplingParams(temperature=0, max_tokens=1)
    for tp in (1, 2):
        llm = LLM(tp_model, tensor_parallel_size=tp, num_gpu_blocks=64)
        calls[f"tp{tp}"].clear()  # the profile run at start-up is not a step
        llm.generate(["Hello"], one_step, use_tqdm=False)  # one prefill step = one forward
        llm.llm_engine.shutdown()
    layers = 2
    assert calls["tp1"] == []
    assert sorted(calls["tp2"]) == [0] * (2 * layers) + [1] * (2 * layers)


# ---- uni: every rank a thread of this process ---------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_uni_matches_tp1(tp_model, reference, tp):
    llm = LLM(tp_model, tensor_parallel_size=tp, **ENGINE)
    assert generate(llm) == reference
    ranks = llm.llm_engine.executor.collective_rpc("profile")
    assert [r["rank"] for r in ranks] == list(range(tp))
    assert {(r["local_num_heads"], r["local_num_kv_heads"], r["kv_bytes_per_block"]) for r in ranks} == {
        (8 // tp, 4 // tp, 2 * 2 * 4 * (4 // tp) * 8 * 4)
    }  # K and V, layers, block, local_nkvh, head_dim, fp32
    llm.llm_engine.shutdown()


# ---- mp: one process per rank over gloo ---------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mp_matches_tp1(tp_model, reference, tp):
    llm = LLM(tp_model, tensor_parallel_size=tp, distributed_executor_backend="mp", master_port=0, **ENGINE)
    try:
        assert generate(llm) == reference
        ranks = llm.llm_engine.executor.collective_rpc("profile")
        assert [r["rank"] for r in ranks] == list(range(tp)) and len({r["pid"] for r in ranks}) == tp
        assert {r["local_num_kv_heads"] for r in ranks} == {4 // tp}
        llm.llm_engine.executor.check_health()
        if tp == 2:  # a worker that dies: the driver names its rank and stops the others, no hang
            victim = llm.llm_engine.executor.procs[1]
            os.kill(victim.pid, signal.SIGKILL)
            with pytest.raises(RuntimeError, match=r"worker rank=1 \(pid \d+\) died"):
                llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert not any(p.is_alive() for p in llm.llm_engine.executor.procs)
        if tp == 4:  # a step that fails on the ranks: named, and the workers are stopped (their state is unknown)
            with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank=\d.*(failed in execute_step|died)"):
                llm.llm_engine.executor.collective_rpc("execute_step", None, gather=False)
            assert not any(p.is_alive() for p in llm.llm_engine.executor.procs)
            with pytest.raises(RuntimeError, match="shut down"):
                llm.llm_engine.executor.check_health()
    finally:
        llm.llm_engine.shutdown()
    assert not any(p.is_alive() for p in llm.llm_engine.executor.procs)


@pytest.mark.timeout(120)
def test_mp_two_nodes_on_loopback(tp_model, reference, tmp_path):
    """node_rank 1 is a second launch (its own process tree) joining node 0's engine over TCP; it takes the
    engine's settings (async scheduling here) from node 0."""
    port = free_port()
    log = open(tmp_path / "node1.log", "w+")  # a file, not a pipe: a full pipe would block the node
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "novainfer.executor.node_worker",
            tp_model,
            "-tp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            str(port),
        ],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    llm = None
    try:
        llm = LLM(
            tp_model,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            nnodes=2,
            master_port=port,
            async_scheduling=True,
            **ENGINE,
        )
        assert generate(llm) == reference  # the overlapped loop: node 1's rank pipelines steps too
        llm.llm_engine.engine_core.async_scheduling = False  # the same ranks, the synchronous loop
        assert generate(llm) == reference
        ranks = llm.llm_engine.executor.collective_rpc("profile")
        assert [r["rank"] for r in ranks] == [0, 1] and ranks[1]["pid"] != ranks[0]["pid"]
        llm.llm_engine.shutdown()
        node1.wait(timeout=30)
        out = (tmp_path / "node1.log").read_text()
        assert node1.returncode == 0, out
        assert "rank=1 local_rank=0 device=cpu tp_size=2" in out  # the start-up log line
    finally:
        if llm is not None:
            llm.llm_engine.shutdown()
        if node1.poll() is None:
            node1.terminate()  # the node stops its ranks on SIGTERM
            try:
                node1.wait(10)
            except subprocess.TimeoutExpired:
                node1.kill()
                node1.wait(10)
        log.close()


def test_step_wire_sends_deltas_and_rebuilds_the_step():
    """mp steps carry appended tokens and changed block tables only; workers rebuild the same sequences."""
    import pickle

    from novainfer.step_types import ScheduledSequence, SchedulerOutput
    from novainfer.sequence import Sequence
    from novainfer.executor.step_wire import StepPacker, StepReceiver

    seqs = [Sequence(list(range(10 * i, 10 * i + 7)), SamplingParams(seed=i)) for i in range(3)]
    packer, receiver = StepPacker(), StepReceiver(worker=None)
    for step in range(4):
        for s in seqs:
            s.block_table = [] if step == 2 and s is seqs[0] else s.block_table + [step]  # seqs[0] preempted
        msg = pickle.loads(pickle.dumps(packer.pack(SchedulerOutput([ScheduledSequence(s, 1) for s in seqs]))))
        got = receiver.unpack(msg)
        for s, g in zip(seqs, got.scheduled):
            assert (g.seq.token_ids, g.seq.block_table, g.seq.sampling_params.seed, g.num_new_tokens, g.samples) == (
                s.token_ids,
                s.block_table,
                s.sampling_params.seed,
                1,
                s.num_computed_tokens + 1 == len(s),
            )
            assert g.seq.prompt_token_ids == s.prompt_token_ids and g.seq.output_token_ids == s.output_token_ids
        if step:
            assert all(len(r[4]) == 1 for r in msg.rows) and not msg.new_seqs  # one appended token each
        for s in seqs:
            s.token_ids.append(100 + step)
            s.num_computed_tokens = len(s) - 1
    msg = packer.pack(SchedulerOutput([ScheduledSequence(seqs[1], 1)], finished_seq_ids=[seqs[0].seq_id]))
    receiver.unpack(msg)
    assert seqs[0].seq_id not in receiver.seqs and seqs[0].seq_id not in packer.sent


@pytest.mark.timeout(60)
def test_uni_rank_failure_is_named_and_does_not_hang(tp_model, reference, monkeypatch):
    """A rank that raises mid-step wakes the ranks waiting for it at the all-reduce; the next step works."""
    from novainfer.worker.worker import Worker

    llm = LLM(tp_model, tensor_parallel_size=2, **ENGINE)
    run = Worker.execute_model
    fail = [True]

    def flaky(self, sched):
        if self.rank == 1 and fail[0]:
            fail[0] = False
            raise ValueError("injected failure")
        return run(self, sched)

    monkeypatch.setattr(Worker, "execute_model", flaky)
    with pytest.raises(ValueError, match="injected failure") as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert "raised by tensor-parallel rank 1 in execute_model (uni backend)" in info.value.__notes__
    assert generate(llm) == reference
    llm.llm_engine.shutdown()
