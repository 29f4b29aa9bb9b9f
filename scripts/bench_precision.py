#!/usr/bin/env python3
"""Mixed precision (`train.precision`): peak RSS, the memory estimate and tokens/s of a job
in f32 and in bf16, the two alternating round by round, medians printed
(docs/benchmarks.md, "Mixed precision (train.precision)").

    scripts/bench_precision.py [--rounds 3] [--exe target/release/pipefill] JOB...

JOB is `default` (the default job: 4 pipelined stages, drafter filler, 50 steps), `seq512`
(the default job at seq_len 512: where activations weigh most), or `qwen05` (Qwen2.5-0.5B's
shape, vocab 151936, d_model 896, 14 heads over 2, q/k/v biases, intermediate 4864, tied
embeddings, at 2 of its 24 layers so that it fits the box, whole on one device, 3 steps of
4 × 64 tokens). Each run is one process under `/usr/bin/time` (its peak RSS); the estimate
is its `memory:` line, tokens/s its `done:` line.
"""

import argparse
import os
import re
import statistics
import subprocess
import tempfile

QWEN05 = [
    "model.vocab=151936",
    "model.d_model=896",
    "model.heads=14",
    "model.kv_heads=2",
    "model.intermediate=4864",
    'model.positions="rope"',
    'model.activation="swiglu"',
    "model.qkv_bias=true",
    "model.tie_embeddings=true",
    "model.layers=2",
    "model.seq_len=64",
    'schedule="none"',
    "train.micro_batches=1",
    "train.micro_batch_size=4",
    "train.steps=3",
    "train.eval_tasks=0",
    "data.summary_tasks=50",
]

# Each job's `--set`s and other arguments: the estimate of qwen05 (82 bytes per parameter in
# bf16, 302 M parameters with the tied head's transposed copy) is over this box's 22 GiB,
# three times what it measures, so its limit is raised.
JOBS = {
    "default": (["train.steps=50", "train.eval_tasks=0"], []),
    "seq512": (["model.seq_len=512", "train.steps=5", "train.eval_tasks=0"], []),
    "qwen05": (QWEN05, ["--max-memory", "40GiB"]),
}


def tok_s(text):
    m = re.search(r"done: .*? ([0-9.]+) tok/s", text)
    return float(m.group(1)) if m else float("nan")


def estimate_mib(text):
    m = re.search(r"memory: ([0-9.]+) (KiB|MiB|GiB) estimated", text)
    if not m:
        return float("nan")
    scale = {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[m.group(2)]
    return float(m.group(1)) * scale


def run(exe, job, precision, out):
    sets, extra = JOBS[job]
    fd, rss = tempfile.mkstemp(suffix=".rss")
    os.close(fd)
    args = ["train"]
    for s in sets + [f'train.precision="{precision}"']:
        args += ["--set", s]
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "%M", "-o", rss, exe] + args + extra + ["--out-dir", out],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{exe} failed:\n{proc.stdout}")
    with open(rss) as f:
        kb = int(f.read().split()[-1])
    os.unlink(rss)
    return {
        "rss": kb * 1024 / 1e6,
        "est": estimate_mib(proc.stdout),
        "tok_s": tok_s(proc.stdout),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exe", default="target/release/pipefill")
    ap.add_argument("jobs", nargs="+", choices=sorted(JOBS))
    a = ap.parse_args()
    med = statistics.median
    for job in a.jobs:
        runs = {"f32": [], "bf16": []}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.rounds):
                for precision in ("f32", "bf16"):
                    out = os.path.join(tmp, f"{r}-{precision}")
                    got = run(a.exe, job, precision, out)
                    runs[precision].append(got)
                    print(f"{job} round {r} {precision}: {got}", flush=True)
        print(f"\n{job}: medians of {a.rounds} alternating rounds")
        print("| precision | peak RSS | estimate | tok/s |")
        for precision, got in runs.items():
            print(
                f"| {precision} | {med([x['rss'] for x in got]):.1f} MB "
                f"| {med([x['est'] for x in got]):.1f} MiB "
                f"| {med([x['tok_s'] for x in got]):.0f} |"
            )


if __name__ == "__main__":
    main()
