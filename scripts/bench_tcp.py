#!/usr/bin/env python3
"""What a launched run sends between its stages, and its step time, under two or more
pipefill binaries (e.g. before and after a wire-format change), the binaries alternating
run by run, medians printed (docs/benchmarks.md: "Mixed precision", "Over TCP").

    scripts/bench_tcp.py [--rounds 5] [--steps 6] [--ranks 2] --exe LABEL=PATH... [-- SET...]

Each run is `PATH launch -n RANKS -- train --set SET...` (default: the bf16 job of 2 stages of
1F1B at d_model 256, seq_len 256) with `RUST_LOG=pipefill::comm=info`, so every rank's
mesh logs what it wrote when it closes (`TcpMesh::sent`, channel MAX-1 is the activations
and gradients between stages). Printed per binary: the tensor channel's bytes a step (all
ranks, summed; the same every step), everything the meshes wrote in the whole run (with the
start, the drafter's exchanges and the final checkpoint), and the median of rank 0's
per-step wall seconds (metrics.jsonl) over steps 2.., then the median over rounds.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

JOB = [
    'train.precision="bf16"',
    'schedule="1f1b"',
    "stages=2",
    "model.d_model=256",
    "model.seq_len=256",
    "train.eval_tasks=0",
]

SENT = re.compile(r"rank (\d+) sent (\d+) bytes in (\d+) frames(.*)")
CHANNEL = re.compile(r"channel (MAX-\d+|\d+): (\d+) bytes in (\d+) frames")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run(exe, ranks, steps, sets):
    """One launched run: (tensor bytes a step, mesh bytes in all, median step seconds)."""
    with tempfile.TemporaryDirectory() as cwd:
        args = [exe, "launch", "-n", str(ranks), "--", "train"]
        for s in sets + [f"train.steps={steps}"]:
            args += ["--set", s]
        env = dict(os.environ, RUST_LOG="pipefill::comm=info")
        out = subprocess.run(
            args, cwd=cwd, env=env, capture_output=True, text=True, check=True
        )
        text = ANSI.sub("", out.stdout + out.stderr)
        tensor = total = 0
        seen = 0
        for m in SENT.finditer(text):
            seen += 1
            total += int(m.group(2))
            for c in CHANNEL.finditer(m.group(4)):
                if c.group(1) == "MAX-1":
                    tensor += int(c.group(2))
        if seen != ranks:
            raise SystemExit(f"{exe}: {seen} of {ranks} ranks logged their traffic:\n{text}")
        (run_dir,) = [os.path.join(cwd, "runs", d) for d in os.listdir(os.path.join(cwd, "runs"))]
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            secs = [json.loads(line)["seconds"] for line in f if line.strip()]
        return tensor / steps, total, statistics.median(secs[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--exe", action="append", required=True, help="LABEL=PATH")
    p.add_argument("sets", nargs="*", help="--set values (default: the bf16 job above)")
    a = p.parse_args()
    exes = [e.split("=", 1) for e in a.exe]
    sets = a.sets or JOB
    results = {label: [] for label, _ in exes}
    for r in range(a.rounds):
        # Alternate the order round by round, so neither binary always runs first.
        order = exes if r % 2 == 0 else exes[::-1]
        for label, exe in order:
            t, m, s = run(exe, a.ranks, a.steps, sets)
            results[label].append((t, m, s))
            print(
                f"round {r + 1} {label}: tensors {t:.0f} B/step, "
                f"mesh {m} B in all, step {s:.3f} s",
                flush=True,
            )
    print(f"\nmedians of {a.rounds} rounds, {a.steps} steps each ({' '.join(sets)}):")
    print("binary | tensor channel bytes/step | mesh bytes, whole run | step seconds")
    for label, _ in exes:
        cols = list(zip(*results[label]))
        t, m, s = (statistics.median(c) for c in cols)
        print(f"{label} | {t:.0f} | {m:.0f} | {s:.3f}")


if __name__ == "__main__":
    main()
