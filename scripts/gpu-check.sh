#!/usr/bin/env bash
# GPU check for a session that has a CUDA device: `device = "cuda"` end to end.
#
#   scripts/gpu-check.sh            # from anywhere; it works in the repository root
#   scripts/gpu-check.sh build      # only step 1 (binary and test binaries), for machines
#                                   # that limit one command's time: run it first, then
#                                   # the whole script, which reuses the build
#   scripts/gpu-check.sh pack DIR   # builds here and copies the binary and the two test
#                                   # binaries into DIR, for a GPU machine without a Rust
#                                   # toolchain: there, PIPEFILL_PREBUILT=DIR scripts/gpu-check.sh
#                                   # runs them instead of cargo
#   GPU_CHECK_PARTS="checks throughput tlt" scripts/gpu-check.sh
#                                   # the parts to run (default: checks): the checks below,
#                                   # training throughput on a larger model, and RL with a
#                                   # drafter trained in a pipeline's bubbles, speculation on
#                                   # and off (the TLT figures)
#
# The binaries load CUDA's libraries at run time under the names of CUDA 12 or unversioned
# (cudarc's candidates); on a CUDA 13 machine, whose libraries are .so.13, the script links
# the unversioned names to what it finds (the toolkit, pip's nvidia-* wheels) in a directory
# put first on LD_LIBRARY_PATH.
#
# 1. builds the binary and tests with `--features cuda` (its own target directory,
#    target/cuda unless CARGO_TARGET_DIR is set, so the default build stays untouched);
# 2. runs the CUDA backend tests (tests/cuda_backend.rs, the lib's tensor::cuda), the
#    comm tests (NCCL p2p, all-reduce, NcclTransport, transport selection) and the launched
#    train's unit tests (mesh channels incl. NCCL's) with the feature on;
# 3. trains one small job as launched ranks on the GPUs, `transport = "nccl"` against
#    `transport = "tcp"` on the same GPUs, and compares every tensor of the two final
#    checkpoints (parameters and AdamW moments), with 2+ GPUs: a 2-stage pipeline (tensors
#    over NcclTransport) and 2 data-parallel replicas (gradients over NcclGradSync, and
#    with `optimizer.shard = true` its reduce-scatter and all-gather against unsharded); also
#    `auto` (must pick NCCL) and the GPU runs against the same launched jobs on the CPU.
#    A rank's GPU is its local rank, so with one GPU the NCCL runs are reported as skipped
#    (NCCL refuses two ranks on one GPU), and two ranks are started by hand, both with local
#    rank 0 as on two one-GPU machines, on cuda:0 over TCP, against the CPU: the GPU
#    pipeline runtime, GPU buffers on the wire and the all-reduce of GPU gradients.
# 4. the reference trainer (`schedule = "none"`) on the GPU against the CPU, and the
#    single-process pipeline of a Llama-shaped model (RoPE, GQA, SwiGLU) likewise, and
#    `pipefill rl` in one process on the GPU (3 steps, speculative rollouts).
#
# Tolerances (max |a - b| over every compared element):
#   NCCL vs TCP, same GPUs: TOL_TRANSPORT = 1e-6. The transports carry the same bits and a
#     2-replica sum is order-free, so bitwise equality is expected; the count of differing
#     elements is printed.
#   GPU vs CPU, parameters only (moments amplify rounding): TOL_DEVICE = 1e-2 after 3 steps
#     at lr 1e-3: cuBLAS and the CPU gemm sum in different orders, so the two agree to
#     rounding, while a wrong kernel or a dropped gradient is off by far more.
# Every step runs under `timeout`; a skipped test on a machine with a GPU, a failed step or a
# tolerance exceeded makes the script exit non-zero, after the summary.
set -uo pipefail

cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda}"
TOL_TRANSPORT="${TOL_TRANSPORT:-1e-6}"
TOL_DEVICE="${TOL_DEVICE:-1e-2}"
# Seconds each training run and each test binary may take (a hang costs no more).
STEP_LIMIT="${GPU_CHECK_STEP_LIMIT:-300}"
TEST_LIMIT="${GPU_CHECK_TEST_LIMIT:-600}"
OUT="${GPU_CHECK_OUT:-$(mktemp -d /tmp/pipefill-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
PREBUILT="${PIPEFILL_PREBUILT:-}"
EXE="${PREBUILT:+$PREBUILT/pipefill}"
EXE="${EXE:-$CARGO_TARGET_DIR/release/pipefill}"
declare -a SUMMARY=()
FAILED=0

say() { printf '\n=== %s\n' "$*"; }
record() { # record STATUS NAME [DETAIL]
    SUMMARY+=("$(printf '%-5s %s%s' "$1" "$2" "${3:+ ($3)}")")
    [ "$1" = FAIL ] && FAILED=1
    return 0
}

# run NAME LIMIT_S COMMAND...: the step's output is kept in $OUT/NAME.log; a non-zero exit
# or a test that skipped (no usable device, said by the test itself) fails the step.
run() {
    local name="$1" limit="$2"
    shift 2
    say "$name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc="${PIPESTATUS[0]}"
    if [ "$rc" -ne 0 ]; then
        record FAIL "$name" "exit $rc$([ "$rc" -eq 124 ] && echo ", timed out after ${limit}s")"
        return 1
    fi
    # NCCL tests of more ranks than GPUs skip where NCCL refuses two ranks on one GPU: that
    # is the machine's limit, not a missing device (counted in the summary).
    local skips shared
    skips="$(grep -E '^SKIP |: skipped: ' "$OUT/$name.log" | grep -v 'NCCL refuses two ranks on one GPU')"
    shared="$(grep -c 'NCCL refuses two ranks on one GPU' "$OUT/$name.log")"
    if [ -n "$skips" ]; then
        record FAIL "$name" "a test skipped on a machine with a GPU: $(head -n 1 <<<"$skips")"
        return 1
    fi
    record ok "$name" "$([ "$shared" -gt 0 ] && echo "$shared test(s) skipped: NCCL refuses two ranks on one GPU")"
}

# compare NAME DIR_A DIR_B TOL PARAMS_ONLY: every tensor of the two checkpoints, max |a-b|.
compare() {
    local name="$1" a="$2/checkpoint/model.safetensors" b="$3/checkpoint/model.safetensors"
    say "compare $name: $a vs $b (tolerance $4)"
    local verdict
    verdict="$(python3 - "$a" "$b" "$4" "$5" <<'EOF'
import json, math, struct, sys

def load(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        if t["dtype"] != "F32":
            sys.exit(f"{path}: {name} is {t['dtype']}, expected F32")
        lo, hi = t["data_offsets"]
        out[name] = struct.unpack(f"<{(hi - lo) // 4}f", data[lo:hi])
    return out

a, b = load(sys.argv[1]), load(sys.argv[2])
tol, params_only = float(sys.argv[3]), sys.argv[4] == "1"
if set(a) != set(b):
    sys.exit(f"different tensors: only in a {sorted(set(a) - set(b))}, only in b {sorted(set(b) - set(a))}")
worst, where, differing, total = 0.0, "", 0, 0
for name in sorted(a):
    if params_only and name.startswith("optim."):
        continue
    if len(a[name]) != len(b[name]):
        sys.exit(f"{name}: {len(a[name])} vs {len(b[name])} elements")
    for x, y in zip(a[name], b[name]):
        total += 1
        if not (math.isfinite(x) and math.isfinite(y)):
            sys.exit(f"{name}: non-finite value ({x} vs {y})")
        d = abs(x - y)
        differing += x != y
        if d > worst:
            worst, where = d, name
print(f"max |a-b| = {worst:.3e} (in {where or '-'}), {differing}/{total} elements differ, tolerance {tol:g}")
sys.exit(0 if worst <= tol else 3)
EOF
)"
    local rc=$?
    echo "$verdict"
    if [ "$rc" -eq 0 ]; then record ok "compare $name" "$verdict"; else record FAIL "compare $name" "$verdict"; fi
}

# A small job (seconds per run on a GPU): ZB-H1, clipping on so gradient statistics cross
# ranks, no filler (the drafter is not the subject here), 3 steps.
JOB=(--set 'schedule="zb-h1"' --set 'filler="none"' --set model.d_model=32 --set model.heads=2
     --set model.layers=4 --set model.seq_len=32 --set train.micro_batches=4
     --set train.micro_batch_size=2 --set train.steps=3 --set train.clip=0.5 --set train.lr=1e-3
     --set train.eval_tasks=0 --set data.summary_tasks=20)

# by_hand NAME STAGES DP DEVICE TRANSPORT [rl]: a 2-rank job (training, or with `rl` the
# RL job of the checks' RL settings) whose ranks this script starts itself, both with local
# rank 0 (as on two one-GPU machines): on one GPU both use cuda:0.
by_hand() {
    local name="$1" stages="$2" dp="$3" device="$4" transport="$5" what="${6:-train}"
    local port token r rc=0 extra=()
    [ "$what" = rl ] && extra=("${RL[@]}" --steps 2)
    port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    token="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
    say "$name: 2 ranks started by hand, local rank 0 each, device $device, transport $transport"
    local pids=()
    for r in 0 1; do
        PIPEFILL_RANK="$r" PIPEFILL_WORLD_SIZE=2 PIPEFILL_LOCAL_RANK=0 \
            PIPEFILL_MASTER_ADDR=127.0.0.1 PIPEFILL_MASTER_PORT="$port" PIPEFILL_TOKEN="$token" \
            timeout "$STEP_LIMIT" "$EXE" "$what" "${JOB[@]}" "${extra[@]}" --set "stages=$stages" --set "dp=$dp" \
            --set "device=\"$device\"" --set "transport=\"$transport\"" \
            --out-dir "$OUT/$name" >"$OUT/$name.rank$r.log" 2>&1 &
        pids+=("$!")
    done
    for r in 0 1; do
        wait "${pids[$r]}" || rc=$?
        sed "s/^/[rank $r] /" "$OUT/$name.rank$r.log"
    done
    if [ "$rc" -ne 0 ]; then
        record FAIL "$name" "a rank exited with $rc"
        return 1
    fi
    record ok "$name"
}

# launched NAME NPROC STAGES DP DEVICE TRANSPORT [ARGS...]: one launched training run into
# $OUT/NAME, ARGS added to the job's.
launched() {
    local name="$1" n="$2" stages="$3" dp="$4" device="$5" transport="$6"
    shift 6
    run "$name" "$STEP_LIMIT" "$EXE" launch -n "$n" -- train "${JOB[@]}" --set "stages=$stages" \
        --set "dp=$dp" --set "device=\"$device\"" --set "transport=\"$transport\"" \
        "$@" --out-dir "$OUT/$name"
}

# cuda_libs: a directory of unversioned links to CUDA's libraries, first on LD_LIBRARY_PATH,
# with the directories they were found in after it (NVRTC loads its builtins from there).
cuda_libs() {
    local links="$OUT/cuda-libs" dirs=() lib found dir
    mkdir -p "$links"
    for lib in cuda cublas cublasLt nvrtc nccl; do
        # The first directory (in this order: toolkit, driver, system, pip wheels) that has it.
        found=""
        for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
            /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/local/lib /opt /usr/local; do
            [ -d "$dir" ] || continue
            found="$(find "$dir" -maxdepth 10 -name "lib$lib.so*" \( -type f -o -type l \) \
                2>/dev/null | grep -v /stubs/ | grep -E "/lib$lib\.so(\.[0-9]+)*$" | sort -V | tail -n 1)"
            [ -n "$found" ] && break
        done
        if [ -n "$found" ]; then
            ln -sf "$found" "$links/lib$lib.so"
            dirs+=("$(dirname "$found")")
            echo "lib$lib.so -> $found"
        else
            echo "lib$lib.so: not found"
        fi
    done
    local joined
    joined="$(printf '%s\n' "${dirs[@]}" | awk '!seen[$0]++' | paste -sd:)"
    export LD_LIBRARY_PATH="$links${joined:+:$joined}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# test NAME FILTER...: one test binary, by cargo, or prebuilt (lib or cuda_backend).
test_bin() {
    local name="$1" which="$2"
    shift 2
    if [ -n "$PREBUILT" ]; then
        run "$name" "$TEST_LIMIT" "$PREBUILT/$which" "$@" --nocapture
    elif [ "$which" = lib ]; then
        run "$name" "$TEST_LIMIT" cargo test --release --features cuda --lib "$@" -- --nocapture
    else
        run "$name" "$TEST_LIMIT" cargo test --release --features cuda --test "$which" "$@" -- --nocapture
    fi
}

if [ "${1:-}" = pack ]; then
    dest="${2:?pack needs a directory}"
    mkdir -p "$dest"
    cargo build --release --features cuda --bin pipefill || exit 1
    cp "$CARGO_TARGET_DIR/release/pipefill" "$dest/pipefill"
    for which in lib cuda_backend; do
        args=(--lib)
        [ "$which" = lib ] || args=(--test "$which")
        bin="$(cargo test --release --features cuda --no-run "${args[@]}" --message-format=json 2>/dev/null |
            python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | tail -n 1)"
        [ -n "$bin" ] || { echo "pack: no test binary for $which"; exit 1; }
        cp "$bin" "$dest/$which"
    done
    ls -l "$dest"
    exit 0
fi

say "machine"
timeout 30 nvidia-smi -L || record FAIL "nvidia-smi" "no GPU listed"
GPUS="$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
echo "GPUs: $GPUS; target dir: $CARGO_TARGET_DIR; outputs: $OUT"
command -v python3 >/dev/null || record FAIL "python3" "needed to compare checkpoints"
say "CUDA libraries"
cuda_libs

if [ "${1:-}" = build ]; then
    run build 590 cargo build --release --features cuda &&
        run build-tests 590 cargo test --release --features cuda --no-run --lib --test cuda_backend
    say "summary"
    printf '%s\n' "${SUMMARY[@]}"
    exit "$FAILED"
fi

PARTS=" ${GPU_CHECK_PARTS:-checks} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
[ -n "$PREBUILT" ] || run build 590 cargo build --release --features cuda || PARTS=""

if part checks; then
    test_bin cuda-backend cuda_backend
    test_bin lib-tensor-cuda lib tensor::cuda
    test_bin lib-comm lib comm
    test_bin lib-launch-train lib launch::train

    # The reference trainer on one GPU against the CPU (needs no second GPU).
    run reference-cuda "$STEP_LIMIT" "$EXE" train "${JOB[@]}" --set 'schedule="none"' --device cuda \
        --out-dir "$OUT/reference-cuda" &&
        run reference-cpu "$STEP_LIMIT" "$EXE" train "${JOB[@]}" --set 'schedule="none"' --device cpu \
            --out-dir "$OUT/reference-cpu" &&
        compare "reference gpu-vs-cpu" "$OUT/reference-cuda" "$OUT/reference-cpu" "$TOL_DEVICE" 1

    # The single-process pipeline (ZB-H1 on 2 ranks, each on GPU rank mod count; a Llama-
    # shaped model so RoPE, GQA and SwiGLU run on the GPU) against the same run on the CPU.
    LLAMA=(--set stages=2 --set model.positions='"rope"' --set model.activation='"swiglu"'
           --set model.kv_heads=1)
    run pipeline-cuda "$STEP_LIMIT" "$EXE" train "${JOB[@]}" "${LLAMA[@]}" --device cuda \
        --out-dir "$OUT/pipeline-cuda" &&
        run pipeline-cpu "$STEP_LIMIT" "$EXE" train "${JOB[@]}" "${LLAMA[@]}" --device cpu \
            --out-dir "$OUT/pipeline-cpu" &&
        compare "pipeline gpu-vs-cpu" "$OUT/pipeline-cuda" "$OUT/pipeline-cpu" "$TOL_DEVICE" 1

    # pipefill rl in one process on the GPU: the policy, the rollouts (speculative, the
    # drafter trained in the rollout stages' idle time) and the update's 2 ranks; each of
    # the 3 steps must be written, the speculation actually used.
    RL=(--set stages=2 --set model.seq_len=64 --set rl.warmup_steps=10 --set rl.prompts=4
        --set rl.group=4 --set rl.max_new_tokens=16 --set rl.drafter_slices=4)
    if run rl-cuda "$STEP_LIMIT" "$EXE" rl "${JOB[@]}" "${RL[@]}" --steps 3 --set 'device="cuda"' \
        --out-dir "$OUT/rl-cuda"; then
        lines="$(wc -l <"$OUT/rl-cuda/metrics.jsonl" 2>/dev/null || echo 0)"
        spec="$(grep -c '"speculation":true' "$OUT/rl-cuda/metrics.jsonl" 2>/dev/null)"
        if [ "$lines" -eq 3 ]; then
            record ok "rl-cuda metrics" "3 steps, ${spec:-0} with speculative rollouts"
        else
            record FAIL "rl-cuda metrics" "$lines lines in metrics.jsonl, 3 expected"
        fi
    fi

    if [ "${GPUS:-0}" -ge 2 ]; then
        # Two pipeline stages: activations and gradients over NcclTransport.
        launched pp2-nccl 2 2 1 cuda nccl && launched pp2-tcp 2 2 1 cuda tcp &&
            compare "pp=2 nccl-vs-tcp" "$OUT/pp2-nccl" "$OUT/pp2-tcp" "$TOL_TRANSPORT" 0
        launched pp2-cpu 2 2 1 cpu tcp &&
            compare "pp=2 gpu-vs-cpu" "$OUT/pp2-nccl" "$OUT/pp2-cpu" "$TOL_DEVICE" 1
        # Two replicas of one stage: gradients all-reduced by NcclGradSync.
        launched dp2-nccl 2 1 2 cuda nccl && launched dp2-tcp 2 1 2 cuda tcp &&
            compare "dp=2 nccl-vs-tcp" "$OUT/dp2-nccl" "$OUT/dp2-tcp" "$TOL_TRANSPORT" 0
        # The sharded optimizer (ZeRO-1) over NCCL: NCCL's reduce-scatter and all-gather; at
        # dp = 2 (a sum of two) bitwise the unsharded run, moments included.
        launched dp2-nccl-shard 2 1 2 cuda nccl --set optimizer.shard=true &&
            compare "dp=2 sharded-vs-unsharded (nccl)" "$OUT/dp2-nccl-shard" "$OUT/dp2-nccl" \
                "$TOL_TRANSPORT" 0
        # auto picks NCCL on GPUs: the same result as nccl.
        launched pp2-auto 2 2 1 cuda auto && grep -qE 'NCCL cannot be used|cannot use NCCL' "$OUT/pp2-auto.log" &&
            record FAIL "pp2-auto" "auto fell back to TCP"
        [ -d "$OUT/pp2-auto" ] &&
            compare "pp=2 auto-vs-nccl" "$OUT/pp2-auto" "$OUT/pp2-nccl" "$TOL_TRANSPORT" 0
    else
        record SKIP "2-rank NCCL runs" "$GPUS GPU(s): a rank's GPU is its local rank, 2 are needed"
        by_hand pp2-cuda-tcp 2 1 cuda tcp && launched pp2-cpu 2 2 1 cpu tcp &&
            compare "pp=2 gpu-vs-cpu (tcp)" "$OUT/pp2-cuda-tcp" "$OUT/pp2-cpu" "$TOL_DEVICE" 1
        by_hand dp2-cuda-tcp 1 2 cuda tcp && launched dp2-cpu 2 1 2 cpu tcp &&
            compare "dp=2 gpu-vs-cpu (tcp)" "$OUT/dp2-cuda-tcp" "$OUT/dp2-cpu" "$TOL_DEVICE" 1
        # A launched rl on the GPU: rank 0's rollouts and both ranks' update stages.
        by_hand rl2-cuda-tcp 2 1 cuda tcp rl
    fi
fi

# Throughput (part "throughput"), on f32 models large enough that the GPU, not the launch
# overhead, sets the pace: the reference trainer on one GPU and the single-process 1F1B
# pipeline with its 4 ranks on the same GPU (each rank its own stream), about 0.1 B
# parameters (each run's `done:` line has its tokens/s, the pipeline's report its measured
# and predicted bubble); then `pipefill rl` with speculation on and off (same warm-up,
# seeds and prompts: rollout tokens/s and share of the step per step in metrics.jsonl);
# last ZB-H1 with the drafter in the bubbles.
if part throughput; then
    BIG=(--set model.d_model=1024 --set model.heads=16 --set model.layers=8
         --set model.seq_len=256 --set train.micro_batches=8 --set train.micro_batch_size=4
         --set train.steps="${GPU_THROUGHPUT_STEPS:-6}" --set train.eval_tasks=0
         --set data.summary_tasks=20 --set train.lr=1e-4 --device cuda)
    run tp-reference 120 "$EXE" train "${BIG[@]}" --set 'schedule="none"' \
        --out-dir "$OUT/tp-reference"
    run tp-1f1b 120 "$EXE" train "${BIG[@]}" --set 'schedule="1f1b"' --set stages=4 \
        --set 'filler="none"' --out-dir "$OUT/tp-1f1b"
    RLBIG=(--set model.d_model=1024 --set model.heads=16 --set model.layers=8
           --set model.seq_len=128 --set stages=2 --set 'filler="none"' --set rl.warmup_steps=30
           --set rl.prompts=8 --set rl.group=8 --set rl.max_new_tokens=64 --set train.eval_tasks=0
           --set data.summary_tasks=20 --set 'device="cuda"' --steps 4)
    run tp-rl-speculative 150 "$EXE" rl "${RLBIG[@]}" --set rl.speculation=true \
        --out-dir "$OUT/tp-rl-speculative"
    run tp-rl-plain 150 "$EXE" rl "${RLBIG[@]}" --set rl.speculation=false \
        --out-dir "$OUT/tp-rl-plain"
    run tp-zb-h1-drafter 150 "$EXE" train "${BIG[@]}" --set 'schedule="zb-h1"' \
        --set stages=4 --set 'filler="drafter"' --out-dir "$OUT/tp-zb-h1-drafter"
fi

# TLT (part "tlt"): a 0.1 B-parameter policy trained by a 2-rank ZB-H1 pipeline on the GPU
# with the drafter in its bubbles, then `pipefill rl --init` from it with speculation on
# and off (same policy, drafter, seeds and prompts): rollout tokens/s, acceptance length
# and the rollouts' share of each step in metrics.jsonl, the medians in the `median step`
# line.
if part tlt; then
    TLT=(--set model.d_model=1024 --set model.heads=16 --set model.layers=8
         --set model.seq_len=128 --set stages=2 --set 'device="cuda"' --set train.eval_tasks=0
         --set data.summary_tasks=20)
    TLT_RL=(--set rl.prompts=8 --set rl.group=8 --set rl.max_new_tokens=64
            --steps "${GPU_TLT_RL_STEPS:-5}")
    if run tlt-train 300 "$EXE" train "${TLT[@]}" --set 'schedule="zb-h1"' \
        --set 'filler="drafter"' --set train.steps="${GPU_TLT_STEPS:-200}" --set train.lr=3e-4 \
        --out-dir "$OUT/tlt-train"; then
        run tlt-rl-speculative 150 "$EXE" rl --init "$OUT/tlt-train" "${TLT[@]}" "${TLT_RL[@]}" \
            --set rl.speculation=true --out-dir "$OUT/tlt-rl-speculative"
        run tlt-rl-plain 150 "$EXE" rl --init "$OUT/tlt-train" "${TLT[@]}" "${TLT_RL[@]}" \
            --set rl.speculation=false --out-dir "$OUT/tlt-rl-plain"
    fi
fi

say "summary (logs and run directories in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
if [ "$FAILED" -ne 0 ]; then
    echo "GPU CHECK FAILED"
    exit 1
fi
echo "GPU CHECK PASSED"
