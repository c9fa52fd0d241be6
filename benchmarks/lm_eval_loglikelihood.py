"""lm-evaluation-harness against `novainfer serve`: a small multiple-choice log-likelihood task, written here,
run with `lm_eval --model local-completions` (which sends `echo` + `logprobs` to /v1/completions), and its
accuracy checked against the same log-likelihoods computed offline with LLM(prompt_logprobs=...).

    pip install "lm_eval[api]"      # only for this script
    python benchmarks/lm_eval_loglikelihood.py [--model PATH] [--dtype float32]

Needs no network: the task's data is a local JSON file, the tokenizer is the served model's, saved locally.
Exits 1 when the accuracies (or any choice's log-likelihood, beyond 1e-3) differ.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin"], 0),
    ("Two plus two equals", [" four", " seven", " ten"], 0),
    ("The sky on a clear day is", [" green", " blue", " red"], 1),
    ("Water freezes at zero degrees", [" Fahrenheit", " Kelvin", " Celsius"], 2),
    ("The opposite of hot is", [" cold", " loud", " tall"], 0),
    ("A week has seven", [" months", " days", " years"], 1),
    ("Cats like to chase", [" mice", " clouds", " trains"], 0),
    ("The sun rises in the", [" west", " north", " east"], 2),
]
TASK_YAML = """task: novainfer_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def write_task(folder: str) -> None:
    data = os.path.join(folder, "data.jsonl")
    with open(data, "w") as f:
        for context, choices, label in QUESTIONS:
            f.write(json.dumps({"context": context, "choices": choices, "label": label}) + "\n")
    with open(os.path.join(folder, "novainfer_ll.yaml"), "w") as f:
        f.write(TASK_YAML.format(data=data))


def offline_loglikelihoods(llm) -> list[list[float]]:
    """Sum of the continuation tokens' logprobs per choice, tokenized as lm_eval does (context, then the rest)."""
    from novainfer import SamplingParams

    tok = llm.get_tokenizer()
    prompts, spans = [], []
    for context, choices, _ in QUESTIONS:
        ctx = tok.encode(context, add_special_tokens=False)
        for choice in choices:
            whole = tok.encode(context + choice, add_special_tokens=False)
            prompts.append({"prompt_token_ids": whole})
            spans.append(len(ctx))
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    flat = [
        sum(o.prompt_logprobs[i][o.prompt_token_ids[i]].logprob for i in range(start, len(o.prompt_token_ids)))
        for o, start in zip(outs, spans)
    ]
    result, k = [], 0
    for _, choices, _ in QUESTIONS:
        result.append(flat[k : k + len(choices)])
        k += len(choices)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the shipped SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    from novainfer import LLM
    from tests.server_utils import RemoteServer

    work = tempfile.mkdtemp(prefix="novainfer-lmeval-")
    write_task(work)
    llm = LLM(args.model, dtype=args.dtype, device="cpu")
    tok_dir = os.path.join(work, "tokenizer")
    llm.get_tokenizer().save_pretrained(tok_dir)
    offline = offline_loglikelihoods(llm)
    offline_acc = sum(max(range(len(ll)), key=ll.__getitem__) == q[2] for ll, q in zip(offline, QUESTIONS)) / len(
        QUESTIONS
    )
    del llm
    server = RemoteServer(
        ([args.model] if args.model else []) + ["--dtype", args.dtype, "--served-model-name", "m"],
        os.path.join(work, "server.log"),
        timeout=300,
    )
    try:
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OPENAI_API_KEY="unused")
        cmd = [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            f"model=m,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tok_dir},"
            "num_concurrent=1,max_retries=1",
            "--tasks",
            "novainfer_ll",
            "--include_path",
            work,
            "--output_path",
            os.path.join(work, "out"),
            "--log_samples",
        ]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, env=env, check=True)
    finally:
        server.stop()
    result = json.load(open(glob.glob(os.path.join(work, "out", "**", "results_*.json"), recursive=True)[0]))
    served_acc = result["results"]["novainfer_ll"]["acc,none"]
    samples = [
        json.loads(line)
        for path in glob.glob(os.path.join(work, "out", "**", "samples_*.jsonl"), recursive=True)
        for line in open(path)
    ]
    worst = 0.0
    for s in samples:
        served = [r[0][0] if isinstance(r[0], list) else r[0] for r in s["resps"]]
        worst = max(worst, max(abs(a - b) for a, b in zip(served, offline[s["doc_id"]])))
    print(
        f"lm_eval accuracy (server) {served_acc:.4f}   offline accuracy {offline_acc:.4f}   "
        f"max |log-likelihood difference| {worst:.2e} over {len(samples)} questions"
    )
    return 0 if served_acc == offline_acc and worst < 1e-3 and len(samples) == len(QUESTIONS) else 1


if __name__ == "__main__":
    sys.exit(main())
