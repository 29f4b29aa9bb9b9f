#!/usr/bin/env python3
"""The memory techniques against their baseline: peak RSS, the memory estimate and tokens/s
of a job under each value of one setting, the values alternating round by round, medians
printed (docs/benchmarks.md: "Mixed precision", "Activation recomputation", "Sharded
optimizer").

    scripts/bench_memory.py [--rounds 3] [--exe target/release/pipefill] [--launched] AXIS JOB...

AXIS is the setting that varies:
- `precision`: train.precision = f32, bf16;
- `recompute`: train.recompute = none, selective, full;
- `shard`: optimizer.shard = false, true, at dp = 2 (the job's stages × 2 replicas);
- `path`: the reference trainer, the pipeline, the pipeline with the drafter filling its
  bubbles (a job of one device pipelined as 2 stages of 1F1B): how close the estimate is.

JOB is `default` (the default job as `pipefill train` runs it: 400 steps, 4 pipelined
stages of ZB-H1, drafter filler), `llama135m` (SmolLM-135M's shape, 2 steps of 4 × 4 × 64
tokens, one device), `seq512` (the
default job at seq_len 512, where activations weigh most), `d512` (d_model 512, 25 M
parameters, 2 stages, no filler), `qwen05` (Qwen2.5-0.5B's shape: vocab 151936, d_model
896, 14 heads over 2, q/k/v biases, intermediate 4864, tied embeddings; at 2 of its 24
layers so that it fits the box, whole on one device; 3 steps of 4 × 64 tokens; the `shard`
axis needs a pipelined job, so not this one), `qwen05-pp2` (the same in 2 stages of
1F1B, 2 micro-batches of 2) or `qwen05-seq1024`
(`qwen05` at seq_len 1024, 2 steps of 2 × 1024 tokens: where its activations weigh).

Each run is one process under `/usr/bin/time` (every rank a thread: the process's peak RSS,
the estimate of the whole job from its `memory:` line, tokens/s from its `done:` line).
With `--launched` each run is also launched, one process per rank started torchrun-style,
each rank's peak RSS printed beside the estimate's per-rank share (the job's / world, as
`pipefill train` checks it).
"""

import argparse
import os
import re
import socket
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

# SmolLM-135M's shape (Llama: vocab 49152, d_model 576, 30 layers, 9 heads over 3,
# intermediate 1536, tied), 2 steps of 4 micro-batches of 4 × 64 tokens, whole on one device.
LLAMA135M = [
    "model.vocab=49152",
    "model.d_model=576",
    "model.heads=9",
    "model.kv_heads=3",
    "model.layers=30",
    "model.intermediate=1536",
    'model.positions="rope"',
    'model.activation="swiglu"',
    "model.tie_embeddings=true",
    "model.seq_len=64",
    'schedule="none"',
    "train.micro_batches=4",
    "train.micro_batch_size=4",
    "train.steps=2",
    "train.eval_tasks=0",
    "data.summary_tasks=50",
]

# Each job's `--set`s, other arguments, and its ranks (per replica).
JOBS = {
    "default": ([], [], 4),
    "llama135m": (LLAMA135M, [], 1),
    "seq512": (["model.seq_len=512", "train.steps=5", "train.eval_tasks=0"], [], 4),
    "d512": (
        [
            "stages=2",
            'filler="none"',
            "model.d_model=512",
            "model.heads=8",
            "train.steps=3",
            "train.eval_tasks=0",
            "data.summary_tasks=50",
        ],
        [],
        2,
    ),
    "qwen05": (QWEN05, [], 1),
    "qwen05-pp2": (
        QWEN05
        + [
            "stages=2",
            'schedule="1f1b"',
            'filler="none"',
            "train.micro_batches=2",
            "train.micro_batch_size=2",
        ],
        [],
        2,
    ),
    "qwen05-seq1024": (
        QWEN05
        + ["model.seq_len=1024", "train.micro_batch_size=2", "train.steps=2"],
        [],
        1,
    ),
}

# Each axis: its values, as `--set`s.
AXES = {
    "precision": [("f32", ['train.precision="f32"']), ("bf16", ['train.precision="bf16"'])],
    "recompute": [
        (mode, [f'train.recompute="{mode}"']) for mode in ("none", "selective", "full")
    ],
    # The reference trainer, the pipeline, and the pipeline with the drafter in its bubbles
    # (a job whose own schedule is "none" is pipelined as 2 stages of 1F1B).
    "path": [
        ("reference", ['schedule="none"', 'filler="none"']),
        ("pipeline", ['filler="none"']),
        ("drafter", ['filler="drafter"']),
    ],
    "shard": [
        ("unsharded", ["dp=2", "optimizer.shard=false"]),
        ("sharded", ["dp=2", "optimizer.shard=true"]),
    ],
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


def args_of(job, value_sets, out):
    sets, extra, _ = JOBS[job]
    if 'schedule="none"' in sets and 'schedule="none"' not in value_sets and any(
        v.startswith("filler=") for v in value_sets
    ):
        value_sets = ["stages=2", 'schedule="1f1b"'] + value_sets
    args = ["train"]
    for s in sets + value_sets:
        args += ["--set", s]
    return args + extra + ["--out-dir", out]


def timed(cmd, env=None):
    """Starts `cmd` under /usr/bin/time; returns (process, file its peak RSS goes to)."""
    fd, rss = tempfile.mkstemp(suffix=".rss")
    os.close(fd)
    proc = subprocess.Popen(
        ["/usr/bin/time", "-f", "%M", "-o", rss] + cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, rss


def peak_mb(rss):
    with open(rss) as f:
        kb = int(f.read().split()[-1])
    os.unlink(rss)
    return kb * 1024 / 1e6


def one_process(exe, args):
    proc, rss = timed([exe] + args)
    text = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"{exe} failed:\n{text}")
    return {"rss": peak_mb(rss), "est": estimate_mib(text), "tok_s": tok_s(text)}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched(exe, args, world):
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            PIPEFILL_TOKEN="bench-memory",
        )
        procs.append(timed([exe] + args, env))
    texts = [p.communicate()[0] for p, _ in procs]
    for (p, _), text in zip(procs, texts):
        if p.returncode != 0:
            raise SystemExit(f"a rank failed:\n{text}")
    return {"ranks": [peak_mb(rss) for _, rss in procs], "tok_s": tok_s(texts[0])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exe", default="target/release/pipefill")
    ap.add_argument("--launched", action="store_true")
    ap.add_argument("axis", choices=sorted(AXES))
    ap.add_argument("jobs", nargs="+", choices=sorted(JOBS))
    a = ap.parse_args()
    med = statistics.median
    values = AXES[a.axis]
    for job in a.jobs:
        world = JOBS[job][2] * (2 if a.axis == "shard" else 1)
        runs = {name: {"one": [], "launched": []} for name, _ in values}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.rounds):
                for name, sets in values:
                    out = os.path.join(tmp, f"{r}-{name}")
                    one = one_process(a.exe, args_of(job, sets, out + "-one"))
                    runs[name]["one"].append(one)
                    print(f"{job} round {r} {name}: {one}", flush=True)
                    if a.launched:
                        la = launched(a.exe, args_of(job, sets, out + "-launched"), world)
                        runs[name]["launched"].append(la)
                        print(f"{job} round {r} {name} launched: {la}", flush=True)
        print(f"\n{job}: medians of {a.rounds} alternating rounds")
        head = f"| {a.axis} | peak RSS | estimate | tok/s |"
        if a.launched:
            head += " launched: peak RSS per rank | estimate per rank | tok/s |"
        print(head)
        for name, _ in values:
            one = runs[name]["one"]
            est = med([x["est"] for x in one])
            row = (
                f"| {name} | {med([x['rss'] for x in one]):.1f} MB | {est:.1f} MiB "
                f"| {med([x['tok_s'] for x in one]):.0f} |"
            )
            if a.launched:
                la = runs[name]["launched"]
                ranks = [med([x["ranks"][i] for x in la]) for i in range(world)]
                row += (
                    f" {', '.join(f'{x:.1f}' for x in ranks)} MB | {est / world:.1f} MiB "
                    f"| {med([x['tok_s'] for x in la]):.0f} |"
                )
            print(row)


if __name__ == "__main__":
    main()
