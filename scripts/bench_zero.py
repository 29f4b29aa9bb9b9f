#!/usr/bin/env python3
"""ZeRO-1 (`optimizer.shard`) at dp = 2: peak RSS, the memory estimate and tokens/s of a
job with and without the sharded optimizer, the two alternating round by round, medians
printed (docs/benchmarks.md, "Sharded optimizer").

    scripts/bench_zero.py [--rounds 3] [--exe target/release/pipefill] JOB...

JOB is `default` (the default job at dp = 2: 4 stages × 2 replicas, 30 steps) or `d512`
(d_model 512, 25 M parameters, 2 stages × 2 replicas, no filler, 3 steps). Each is run in
one process (every rank a thread: the process's peak RSS, the estimate of the whole job)
and launched, one process per rank started torchrun-style, each under `/usr/bin/time`
(every rank's peak RSS; the estimate's per-rank share is the job's / world, as
`pipefill train` checks it). tokens/s is the `done:` line's (rank 0's when launched).
"""

import argparse
import os
import re
import socket
import statistics
import subprocess
import tempfile

JOBS = {
    "default": (["dp=2", "train.steps=30", "train.eval_tasks=0"], 8),
    "d512": (
        [
            "dp=2",
            "stages=2",
            'filler="none"',
            "model.d_model=512",
            "model.heads=8",
            "train.steps=3",
            "train.eval_tasks=0",
            "data.summary_tasks=50",
        ],
        4,
    ),
}


def args_of(sets, shard, out):
    args = ["train"]
    for s in sets + [f"optimizer.shard={'true' if shard else 'false'}"]:
        args += ["--set", s]
    return args + ["--out-dir", out]


def tok_s(text):
    m = re.search(r"done: .*? ([0-9.]+) tok/s", text)
    return float(m.group(1)) if m else float("nan")


def estimate_mib(text):
    m = re.search(r"memory: ([0-9.]+) (KiB|MiB|GiB) estimated", text)
    if not m:
        return float("nan")
    scale = {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[m.group(2)]
    return float(m.group(1)) * scale


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


def one_process(exe, sets, shard, out):
    proc, rss = timed([exe] + args_of(sets, shard, out))
    text = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"{exe} failed:\n{text}")
    return {"rss": peak_mb(rss), "est": estimate_mib(text), "tok_s": tok_s(text)}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched(exe, sets, shard, out, world):
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
            PIPEFILL_TOKEN="bench-zero",
        )
        procs.append(timed([exe] + args_of(sets, shard, out), env))
    texts = [p.communicate()[0] for p, _ in procs]
    for (p, _), text in zip(procs, texts):
        if p.returncode != 0:
            raise SystemExit(f"a rank failed:\n{text}")
    return {"ranks": [peak_mb(rss) for _, rss in procs], "tok_s": tok_s(texts[0])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exe", default="target/release/pipefill")
    ap.add_argument("jobs", nargs="+", choices=sorted(JOBS))
    a = ap.parse_args()
    med = statistics.median
    for job in a.jobs:
        sets, world = JOBS[job]
        runs = {(m, s): [] for m in ("one", "launched") for s in (False, True)}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.rounds):
                for shard in (False, True):
                    out = os.path.join(tmp, f"{r}-{shard}")
                    one = one_process(a.exe, sets, shard, out + "-one")
                    runs[("one", shard)].append(one)
                    print(f"{job} round {r} shard={shard} one process: {one}", flush=True)
                    la = launched(a.exe, sets, shard, out + "-launched", world)
                    runs[("launched", shard)].append(la)
                    print(f"{job} round {r} shard={shard} launched: {la}", flush=True)
        print(f"\n{job}: medians of {a.rounds} alternating rounds")
        print("| shard | one process: peak RSS | estimate | tok/s "
              "| launched: peak RSS per rank | estimate per rank | tok/s |")
        for shard in (False, True):
            one = runs[("one", shard)]
            la = runs[("launched", shard)]
            ranks = [med([x["ranks"][i] for x in la]) for i in range(world)]
            est = med([x["est"] for x in one])
            print(
                f"| {str(shard).lower()} | {med([x['rss'] for x in one]):.1f} MB "
                f"| {est:.1f} MiB | {med([x['tok_s'] for x in one]):.0f} "
                f"| {', '.join(f'{x:.1f}' for x in ranks)} MB "
                f"| {est / world:.1f} MiB | {med([x['tok_s'] for x in la]):.0f} |"
            )


if __name__ == "__main__":
    main()
