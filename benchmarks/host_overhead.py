"""Host overhead per decode step, with the device replaced by a simulated one.

The engine's whole host path runs for real (scheduler, block manager, step inputs, sampling metadata,
postprocess, token bookkeeping, incremental detokenization, outputs); the model forward and the sampler are
replaced by a simulated device that does its work off the host thread in a fixed time per step and returns
fixed tokens. The host waits for the device only where it reads the sampled ids back, so

    host ms per step = step wall time - time blocked on the device
    host CPU ms per step = CPU time of the engine's thread (steadier than wall time on a busy machine).

    python benchmarks/host_overhead.py --num-seqs 1 64 256 --simulated-device-ms 2

With overlap on, the host plans and launches step N+1 before it reads step N back, so a step should take
about max(host, device) instead of host + device.

With `-tp 2 --distributed-executor-backend mp` every rank's process gets its own simulated device (installed
through collective_rpc); the host is then the engine's process, and the time it is blocked is the time it
waits for the workers' replies (their step inputs, the simulated device, the pipe), so host ms covers the
engine's process only:

    python -c "from tests.tiny_models import make_tiny_model as m; m('/tmp/tiny-tp2', 'qwen2', num_heads=8, num_kv_heads=4, head_dim=8)"
    python benchmarks/host_overhead.py --model /tmp/tiny-tp2 -tp 2 --distributed-executor-backend mp --num-seqs 1 64
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TEXT = ("The quick brown fox jumps over the lazy dog while the engine schedules the next step and the "
        "device computes this one; paged attention keeps keys and values in blocks of the cache. ")


class PendingTokens:
    """Sampled ids that are still being computed by the simulated device; tolist() waits for them."""

    def __init__(self, future: Future, device: "SimulatedDevice"):
        self.future, self.device = future, device

    def tolist(self) -> list[int]:
        t0 = time.perf_counter()
        ids = self.future.result()
        self.device.blocked_s += time.perf_counter() - t0
        return ids


class SimulatedSample:
    """Stands in for SamplerOutput: no logprobs, ids pending on the simulated device."""

    logprobs = None

    def __init__(self, pending: PendingTokens):
        self.sampled_token_ids = pending


class SimulatedDevice:
    """Each step's forward + sampling takes `ms` on a device thread and yields fixed tokens."""

    def __init__(self, ms: float, tokens: list[int]):
        self.seconds = ms / 1e3
        self.tokens = tokens
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="simulated-device")
        self.blocked_s = 0.0
        self.steps = 0

    def _work(self, rows: int, step: int) -> list[int]:
        deadline = time.perf_counter() + self.seconds
        ids = [self.tokens[(step + r) % len(self.tokens)] for r in range(rows)]
        while time.perf_counter() < deadline:  # sleep() overshoots by ~0.1 ms; the busy tail keeps it exact
            time.sleep(max(0.0, deadline - time.perf_counter() - 2e-4))
        return ids

    def install(self, runner) -> None:
        """Replace the runner's forward and sampler; everything else in it runs for real."""
        def run_model_forward(inp):
            self.steps += 1
            rows = len(inp.logits_indices)
            future = self.pool.submit(self._work, rows, self.steps)
            return future if rows else None

        def sample(future, inp):
            return SimulatedSample(PendingTokens(future, self))

        runner.run_model_forward = run_model_forward
        runner.sample = sample


def install_simulated_device(worker, ms: float, tokens: list[int]) -> None:
    """collective_rpc target: a simulated device in this mp worker's runner (the device time is not reported)."""
    SimulatedDevice(ms, tokens).install(worker.model_runner)


def time_replies(executor, device: SimulatedDevice) -> None:
    """mp: count the engine's waits for the workers' replies as its time blocked on the device."""
    receive = executor._receive

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return receive(*a, **kw)
        finally:
            device.blocked_s += time.perf_counter() - t0
    executor._receive = timed


PHASES = {"schedule": ("engine_core", "schedule"), "step_inputs": ("runner", "prepare_step_inputs"),
          "postprocess": ("runner", "postprocess"), "update_from_output": ("engine_core", "update_from_output"),
          "output_processor": ("output_processor", "process_outputs")}


def time_phases(llm) -> dict[str, float]:
    """Wrap the host path's stages so each adds its engine-thread CPU seconds to the returned dict."""
    engine = llm.llm_engine
    owners = {"engine_core": engine.engine_core, "runner": engine.executor.workers[0].model_runner,
              "output_processor": engine.output_processor}
    spent = dict.fromkeys(PHASES, 0.0)
    for phase, (owner, name) in PHASES.items():
        def timed(*a, _f=getattr(owners[owner], name), _phase=phase, **kw):
            c0 = time.thread_time()
            try:
                return _f(*a, **kw)
            finally:
                spent[_phase] += time.thread_time() - c0
        setattr(owners[owner], name, timed)
    return spent


def run(num_seqs: int, args, llm, device: SimulatedDevice, spent: dict[str, float] | None = None) -> dict:
    from novainfer import SamplingParams
    from novainfer.sampling_params import RequestOutputKind
    engine = llm.llm_engine
    params = SamplingParams(temperature=args.temperature, top_p=0.95, ignore_eos=True, max_tokens=args.output_len,
                            output_kind=RequestOutputKind[args.output_kind.upper()])
    vocab = engine.config.model_config.hf_config.vocab_size
    for i in range(num_seqs):  # distinct prompts: no prefix-cache sharing between sequences
        engine.add_request(f"r{num_seqs}-{i}", [(7 * i + j) % vocab for j in range(args.input_len)], params)
    decode_steps: list[tuple[float, float]] = []
    phase_steps: list[dict[str, float]] = []
    schedule = engine.scheduler.schedule
    while engine.has_unfinished_requests():
        blocked0 = device.blocked_s
        before = dict(spent or {})
        t0, c0 = time.perf_counter(), time.thread_time()
        pure = []
        engine.scheduler.schedule = lambda: pure.append(out := schedule()) or out  # noqa: B023
        engine.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        engine.scheduler.schedule = schedule
        if pure and pure[0].is_pure_decode and len(pure[0].scheduled) == num_seqs:
            decode_steps.append((wall, device.blocked_s - blocked0, cpu))
            phase_steps.append({k: v - before[k] for k, v in (spent or {}).items()})
    steady = decode_steps[len(decode_steps) // 4:]  # drop warm-up steps
    phases = {k: round(1e3 * sum(p[k] for p in phase_steps[len(decode_steps) // 4:]) / len(steady), 3)
              for k in (spent or {})}
    step_ms = 1e3 * sum(w for w, _, _ in steady) / len(steady)
    host_ms = 1e3 * sum(w - b for w, b, _ in steady) / len(steady)
    cpu_ms = 1e3 * sum(c for _, _, c in steady) / len(steady)
    return {"num_seqs": num_seqs, "decode_steps": len(steady), "step_ms": round(step_ms, 3),
            "host_ms": round(host_ms, 3), "host_cpu_ms": round(cpu_ms, 3), "device_ms": args.simulated_device_ms,
            "step_over_max": round(step_ms / max(host_ms, args.simulated_device_ms), 3),
            **({"cpu_ms_by_phase": phases} if spent is not None else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model path (default: the default model); only its "
                                                   "tokenizer and shapes matter")
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--simulated-device-ms", type=float, default=2.0)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--output-kind", choices=["cumulative", "final_only"], default="cumulative",
                    help="cumulative: an output per request per step, as the server streams; final_only: only "
                         "finished outputs, as LLM.generate (benchmarks/throughput.py) reads them")
    ap.add_argument("--split", action="store_true", help="also print each stage's engine-thread CPU ms per step")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile the largest batch's run (host functions)")
    ap.add_argument("--overlap", nargs="+", choices=["off", "on"], default=["off", "on"],
                    help="async scheduling: plan step N+1 while the device runs step N")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--distributed-executor-backend", default="uni", choices=["uni", "mp"])
    args = ap.parse_args()
    mp = args.distributed_executor_backend == "mp"
    if mp and args.split:
        ap.error("--split times the runner's stages in the engine's process: uni only")
    if not mp and args.tensor_parallel_size > 1:
        ap.error("tensor_parallel_size > 1 needs --distributed-executor-backend mp here (uni runs its ranks "
                 "in this process, each step to the end)")

    from novainfer import LLM
    rows = []
    for overlap in args.overlap:
        extra = {"async_scheduling": True} if overlap == "on" else {}  # off: also runs on commits before it
        if mp:
            extra.update(tensor_parallel_size=args.tensor_parallel_size, master_port=0,
                         distributed_executor_backend=args.distributed_executor_backend,
                         async_scheduling=overlap == "on")
        llm = LLM(args.model, max_num_seqs=max(args.num_seqs), device="cpu",
                  cpu_kv_cache_tokens=max(args.num_seqs) * (args.input_len + args.output_len + 32), **extra)
        tokens = llm.get_tokenizer().encode(TEXT, add_special_tokens=False)
        if not tokens:
            raise SystemExit(f"{args.model}'s tokenizer encodes the benchmark text to no tokens (random:<config> "
                             "folders have a word-level one): give a model with a byte-level BPE tokenizer")
        device = SimulatedDevice(args.simulated_device_ms, tokens)
        executor = llm.llm_engine.executor
        if mp:
            executor.collective_rpc(install_simulated_device, args.simulated_device_ms, tokens)
            time_replies(executor, device)
        else:
            device.install(executor.workers[0].model_runner)
        spent = time_phases(llm) if args.split else None
        gc.freeze()  # as the server's core process and LLM.generate do: no 0.3-0.5 s full collections in a window
        rows += [dict(overlap=overlap, **run(n, args, llm, device, spent)) for n in args.num_seqs]
        if args.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.runcall(run, max(args.num_seqs), args, llm, device)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        llm.llm_engine.shutdown()
        gc.unfreeze()
    print(f"{'overlap':>7} {'seqs':>5} {'host ms/step':>13} {'host CPU ms':>12} {'step ms':>8} {'device ms':>10} "
          f"{'step/max(host,dev)':>19}")
    for r in rows:
        print(f"{r['overlap']:>7} {r['num_seqs']:>5} {r['host_ms']:>13.3f} {r['host_cpu_ms']:>12.3f} {r['step_ms']:>8.3f} "
              f"{r['device_ms']:>10.1f} {r['step_over_max']:>19.3f}")
    for r in rows:
        if "cpu_ms_by_phase" in r:
            print(f"{r['overlap']:>7} {r['num_seqs']:>5} CPU ms per step: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_by_phase"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
