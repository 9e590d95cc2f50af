#!/usr/bin/env bash
# The GPU checks of this repo in ONE command of a few minutes, for a lent GPU machine (one H200 or H100).
#
# Through the device tool, from a session whose checkout is this repo:
#     run(command="bash tests/gpu/run_device_checks.sh", timeout_s=540, kind="nvidia-h200")
# kind="nvidia-h200" is needed for rl-gpu-bench's 30B headline (two bf16 copies of a 30B model, ~125
# GiB): the tool's default kind is an H100 with ~78 GiB, on which the headline is sized down to 13B
# (printed, with the reason); everything else runs on either.
# The log, doctor.json and gpu.json come back from $OUT (device_checks.log has everything; the last
# lines of the output are one SUMMARY line per step). Call give_back afterwards unless rerunning.
# Device time: the machine's start counts too, and it goes back about 30 s after a command ends, so
# a second run has to follow at once and be short: e.g. DEVICE_CHECKS_BUDGET_S=150
# DEVICE_CHECKS_RL_GPU=0 with DEVICE_CHECKS_PYTEST_ARGS="-k <the tests that failed>" (a GPU test
# group of which it selects nothing then passes).
#
# That machine has no network and no .venv of this repo: its python3 (3.12.3) has torch, numpy,
# cuda-python, nvidia-nccl-cu13, pytest, pytest-timeout and hypothesis, but NOT msgspec (transport
# cannot be imported without it) nor pytest-asyncio (not needed: the GPU tests that need an event
# loop run their own with asyncio.run; pyproject's asyncio options are then unknown to pytest, and
# that warning is ignored). msgspec's wheels for Python 3.11, 3.12 and 3.13 are in this repo
# (tests/gpu/wheels/, see its README), so nothing has to be carried. The wheels found in
# tests/gpu/wheels/, wheels/ or .whl/ are tried one by one, for each package that does not import
# already, until one installs (pip --no-index into a scratch folder, which is copied into a private
# folder on PYTHONPATH only once the package imports from it: a refused wheel leaves nothing); the
# imports still missing are reported.
#
# Anywhere else: bash tests/gpu/run_device_checks.sh [OUTDIR]   (default $OUT, else /tmp/device-out)
# On a machine without CUDA it runs end to end too: GPU tests and bench skipped, CPU tests run.
#
# Steps, in this order (each under `timeout`, all within a total budget of DEVICE_CHECKS_BUDGET_S =
# 500 s, so that the last step's `timeout -k` grace and the summary end well inside the tool's 540 s;
# a step gets its own bound or what is left of the budget, whichever is less; a failing step does
# not stop the next): nvidia-smi; python/torch/CUDA/NCCL versions; `python -m transport doctor
# --json`; pytest tests/gpu in one step per group, each with its own bound, so that a slow or hung
# group costs only its own time: gpu-nccl (the NCCL binding on a GPU: test_nccl_gpu.py, and the nccl
# plane between two processes: test_nccl_plane_gpu.py; first, the code most in need of a first run),
# gpu-ipc-staged (test_completion_gpu.py; over cuda_ipc between two processes on the GPU:
# test_ipc_gpu.py; CUDA tensors through the staged path: test_staged_gpu.py), gpu-rl (rl_sync GPU to
# GPU in every mode, stream-ordered hold() and push(): test_rl_sync_gpu.py), gpu-other (any other
# tests/gpu file, if there is one); pytest tests/test_nccl_binding.py;
# bench/bench_gpu.py (copies, NCCL library/raw, put over cuda_ipc and staged with their ratios
# against d2d copy_ and pinned h2d); bench/bench_rl_gpu.py (rl_sync: the colocated live push, 30B
# where the GPU has > 130 GB, else 13B; 7B per mode); bench/bench_transport.py --only raw,tcp (CPU: the tcp target
# on a 16-core host; info only); bench/bench_rl_sync.py (CPU: the fan-out target on a 16-core host;
# info only, with what is left of the budget). Exit status 0
# when every check step passed, else 1.

set -u

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
ROOT=$PWD
OUTDIR=${1:-${OUT:-/tmp/device-out}}
mkdir -p "$OUTDIR" || exit 2
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG=$OUTDIR/device_checks.log
STEP_OUT=$OUTDIR/step.out # the running step's output (left behind only if the run is killed mid-step)
: >"$LOG"
export PYTHONUNBUFFERED=1
BUDGET=${DEVICE_CHECKS_BUDGET_S:-500}
GRACE=10 # timeout -k: a step that ignores SIGTERM is killed this long after its bound
START=$SECONDS
SUMMARY=()
FAILED=0

log() { printf '%s\n' "$*" | tee -a "$LOG"; }

# step KIND NAME LIMIT_S CMD...   KIND: check (counts for PASS/FAIL) or info (recorded only)
step() {
    local kind=$1 name=$2 limit=$3
    shift 3
    # what is left, less the kill grace and a few seconds for the log and the summary: the last
    # step ends by BUDGET - 5 s even if it has to be killed
    local left=$((BUDGET - (SECONDS - START) - GRACE - 5))
    if [ "$left" -lt 5 ]; then
        log "=== [$name] not run: the ${BUDGET}s budget is spent"
        SUMMARY+=("$(printf 'SUMMARY %-14s %s' "$name" "$([ "$kind" = check ] && echo FAIL || echo INFO) not run (budget spent)")")
        [ "$kind" = check ] && FAILED=$((FAILED + 1))
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log ""
    log "=== [$name] $(date -u +%H:%M:%S) timeout ${limit}s: $*"
    local t0=$SECONDS
    timeout -k "$GRACE" "$limit" "$@" </dev/null >"$STEP_OUT" 2>&1
    local rc=$?
    cat "$STEP_OUT" | tee -a "$LOG"
    rm -f "$STEP_OUT"
    local secs=$((SECONDS - t0)) verdict note=""
    if [ "$kind" = check ]; then
        if [ "$rc" -eq 0 ]; then verdict=PASS; else verdict=FAIL; FAILED=$((FAILED + 1)); fi
    else
        if [ "$rc" -eq 0 ]; then verdict=INFO; else verdict="INFO(unavailable)"; fi
    fi
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note="timed out at ${limit}s; "; fi
    SUMMARY+=("$(printf 'SUMMARY %-14s %-5s rc=%-3s %4ss  %s' "$name" "$verdict" "$rc" "$secs" "$note")")
    log "=== [$name] $verdict rc=$rc in ${secs}s"
    return 0
}

# annotate TEXT: append TEXT to the last SUMMARY line
annotate() { [ -n "$1" ] && SUMMARY[${#SUMMARY[@]} - 1]="${SUMMARY[${#SUMMARY[@]} - 1]}$1"; return 0; }

# The last pytest result line of a step's log section ("8 passed, 2 skipped in 3.1s").
pytest_note() { sed -n "/^=== \[$1\] .*timeout/,\$p" "$LOG" | grep -E '(passed|failed|skipped|error|errors|no tests ran).* in [0-9.]+s' | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//'; }

log "device checks of $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') ($(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) paths changed), $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), output in $OUTDIR"

# -- the interpreter: the repo's venv if there is one, else the python on PATH that has torch --------
if [ -x "$ROOT/.venv/bin/python" ]; then
    PY=$ROOT/.venv/bin/python
else
    PY=""
    for c in python python3; do
        if command -v "$c" >/dev/null 2>&1 && timeout 60 "$c" -c 'import torch' >/dev/null 2>&1; then
            PY=$(command -v "$c")
            break
        fi
    done
    [ -n "$PY" ] || PY=$(command -v python3 || command -v python || echo python3)
fi
log "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1))"

# -- wheels carried for packages the machine lacks -----------------------------------------------------
# One at a time, and only a wheel whose package does not import here: a carried wheel never shadows
# what the machine has (its numpy is the one its torch was built with). The wheels of one package
# (one per Python: cp311, cp312, cp313) are tried in turn until one installs; the ones after it then
# find the package importable and are passed over. Each goes into a scratch folder first and is
# copied into $SITE only if its package imports from there, so a wheel for another Python or
# platform (refused by pip, or unpacked and not importable) leaves nothing behind.
SITE=/tmp/device-checks-site
SCRATCH=/tmp/device-checks-wheel.$$
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
HAS_PIP=0
timeout 60 "$PY" -m pip --version >/dev/null 2>&1 && HAS_PIP=1
for w in "$ROOT"/tests/gpu/wheels/*.whl "$ROOT"/wheels/*.whl "$ROOT"/.whl/*.whl; do
    [ -e "$w" ] || continue
    wn=$(basename "$w")
    mod=$(printf '%s' "$wn" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
    if timeout 60 "$PY" -c "import $mod" >/dev/null 2>&1; then
        log "wheel $wn: $mod is importable here already; not installed"
        continue
    fi
    rm -rf "$SCRATCH"
    if ! mkdir -p "$SCRATCH"; then log "wheel $wn: NOT installed (cannot make $SCRATCH)"; continue; fi
    if [ "$HAS_PIP" = 1 ]; then
        how="pip --no-index"
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$SCRATCH" "$w" >>"$LOG" 2>&1
    else
        how="unpacked (no pip here)"
        timeout 60 "$PY" -m zipfile -e "$w" "$SCRATCH" >>"$LOG" 2>&1
    fi
    rc=$?
    if [ "$rc" -eq 0 ] && PYTHONPATH="$SCRATCH" timeout 60 "$PY" -c "import $mod" >>"$LOG" 2>&1 \
            && mkdir -p "$SITE" && cp -a "$SCRATCH"/. "$SITE"/; then
        log "wheel $wn: installed into $SITE ($how), and $mod imports"
    elif [ "$rc" -ne 0 ]; then
        log "wheel $wn: NOT installed: $how failed, rc=$rc (another Python or platform? see above); the next one is tried"
    else
        log "wheel $wn: NOT installed: $mod does not import from it (another Python? see above); the next one is tried"
    fi
    rm -rf "$SCRATCH"
done

MISSING=$(timeout 60 "$PY" - <<'EOF' 2>/dev/null
import importlib
missing = []
for name in ("torch", "numpy", "msgspec", "tqdm", "pytest", "pytest_timeout", "pytest_asyncio", "hypothesis",
             "cuda.bindings", "cuda.pathfinder"):
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
print(" ".join(missing))
EOF
)
has() { case " $MISSING " in *" $1 "*) return 1 ;; *) return 0 ;; esac; }
if [ -n "$MISSING" ]; then
    log "MISSING imports: $MISSING"
    has torch || log "  torch: nothing here can run"
    has numpy || log "  numpy: transport hands CPU tensors' bytes around as numpy-backed views, and cuda_ipc builds its views through numpy; carry a numpy wheel (see the header)"
    has msgspec || log "  msgspec: transport cannot be imported, so every test and the bench's NCCL part fail; carry its wheel in .whl/ (see the header)"
    has tqdm || log "  tqdm: transport may fail to import; carry its wheel"
    has pytest || log "  pytest: the test steps cannot run"
    has pytest_timeout || log "  pytest_timeout: no per-test timeout inside pytest (each step's timeout still bounds it)"
    has pytest_asyncio || log "  pytest_asyncio: pyproject's asyncio options are unknown to pytest; that warning is ignored (the GPU tests run their own loops)"
    has hypothesis || log "  hypothesis: not used by these tests"
    has cuda.pathfinder || log "  cuda.pathfinder: one NCCL search step is skipped (torch's NCCL is used first anyway)"
else
    log "imports: all present"
fi

# Only the plugins these tests need: the image's others (cov, xdist, benchmark, anyio, jaxtyping, ...)
# stay out, so that filterwarnings=error meets no warning of theirs.
PYTEST=(env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -p no:cacheprovider)
if has pytest_timeout; then PYTEST+=(-p pytest_timeout --timeout 120); fi
if has pytest_asyncio; then PYTEST+=(-p pytest_asyncio.plugin); fi
# pyproject's asyncio options are unknown to pytest without pytest-asyncio, and an old one may not
# know asyncio_default_fixture_loop_scope: with filterwarnings=error that would stop pytest at start
PYTEST+=(-W ignore::pytest.PytestConfigWarning)

# -- what this machine is --------------------------------------------------------------------------
step info nvidia-smi 15 nvidia-smi

VERSIONS_PY=/tmp/device-checks-versions.py
cat >"$VERSIONS_PY" <<'EOF'
import importlib.metadata as md, json, os, platform, sys
sys.path.insert(0, os.getcwd())  # the repo root: transport is not installed on the device machine
info = {"python": platform.python_version(), "executable": sys.executable}
for dist in ("torch", "cuda-python", "cuda-bindings", "cuda-pathfinder", "nvidia-nccl-cu12", "nvidia-nccl-cu13",
             "msgspec", "tqdm", "pytest", "pytest-timeout", "pytest-asyncio", "hypothesis"):
    try:
        info[dist] = md.version(dist)
    except md.PackageNotFoundError:
        info[dist] = None
try:
    import torch
    info["torch.version.cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    info["device_count"] = torch.cuda.device_count()
    if info["cuda_available"]:
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["torch.cuda.nccl.version"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as exc:
    info["torch_error"] = f"{type(exc).__name__}: {exc}"
try:
    from cuda.bindings import driver
    err, version = driver.cuDriverGetVersion()
    info["cuda_driver_api_version"] = version if int(err) == 0 else str(err)
except Exception as exc:
    info["cuda_driver_api_version"] = f"unavailable: {type(exc).__name__}: {exc}"
try:
    from transport.cuda import load_nccl
    lib = load_nccl()
    info["transport_nccl"] = {"version": lib.version_string, "path": lib.path, "source": lib.source.value}
except Exception as exc:
    info["transport_nccl"] = f"unavailable: {type(exc).__name__}: {exc}"
print(json.dumps(info, indent=2))
EOF
step info versions 45 "$PY" "$VERSIONS_PY"

step info doctor 45 bash -c '"$1" -m transport doctor --json >"$2"' doctor "$PY" "$OUTDIR/doctor.json"
if [ -s "$OUTDIR/doctor.json" ]; then
    log "(doctor --json written to $OUTDIR/doctor.json)"
    cat "$OUTDIR/doctor.json" >>"$LOG"
else
    rm -f "$OUTDIR/doctor.json"
fi

# -- the checks ------------------------------------------------------------------------------------
# DEVICE_CHECKS_PYTEST_ARGS (split on spaces; e.g. "-k ipc") narrows the GPU tests of a short rerun
read -r -a EXTRA <<<"${DEVICE_CHECKS_PYTEST_ARGS:-}"
# One step per group of files, each with its own bound: a hang inside a CUDA/NCCL call on the main
# thread is out of pytest-timeout's reach (its SIGALRM runs only between bytecodes), so only the
# step's timeout ends it, and it then costs only its own group. The NCCL files (the binding, abort of
# an init in progress, two NCCL "hosts" on one GPU over loopback sockets) go first: they are the only
# test of the NCCL binding and plane. The three bounds (120 + 110 + 130 s) leave the budget's rest for
# the binding's CPU tests and the two benches.
# gpu_step NAME LIMIT FILES...: pytest on FILES; with DEVICE_CHECKS_PYTEST_ARGS set, a group that it
# selects nothing of (pytest's rc 5, "no tests ran") passes
GROUP_SH=/tmp/device-checks-pytest-group.sh
cat >"$GROUP_SH" <<'SH'
"$@"
rc=$?
if [ "$rc" -eq 5 ] && [ -n "${DEVICE_CHECKS_PYTEST_ARGS:-}" ]; then
    echo "(no test of this group is selected by DEVICE_CHECKS_PYTEST_ARGS=$DEVICE_CHECKS_PYTEST_ARGS)"
    exit 0
fi
exit "$rc"
SH
export DEVICE_CHECKS_PYTEST_ARGS="${DEVICE_CHECKS_PYTEST_ARGS:-}"
gpu_step() {
    local name=$1 limit=$2
    shift 2
    step check "$name" "$limit" bash "$GROUP_SH" "${PYTEST[@]}" "$@" -v -rA --durations=10 "${EXTRA[@]}"
    annotate "$(pytest_note "$name")"
}
GPU_NCCL=(tests/gpu/test_nccl_gpu.py tests/gpu/test_nccl_plane_gpu.py)
GPU_IPC_STAGED=(tests/gpu/test_completion_gpu.py tests/gpu/test_ipc_gpu.py tests/gpu/test_staged_gpu.py)
GPU_RL=(tests/gpu/test_rl_sync_gpu.py)
GPU_OTHER=()
for f in tests/gpu/test_*.py; do  # a file in no group above runs too, in a step of its own after them
    case " ${GPU_NCCL[*]} ${GPU_IPC_STAGED[*]} ${GPU_RL[*]} " in *" $f "*) ;; *) GPU_OTHER+=("$f") ;; esac
done
gpu_step gpu-nccl 120 "${GPU_NCCL[@]}"
gpu_step gpu-ipc-staged 110 "${GPU_IPC_STAGED[@]}"
gpu_step gpu-rl 130 "${GPU_RL[@]}"
if [ "${#GPU_OTHER[@]}" -gt 0 ]; then gpu_step gpu-other 60 "${GPU_OTHER[@]}"; fi

step check cpu-binding 110 "${PYTEST[@]}" tests/test_nccl_binding.py -v
annotate "$(pytest_note cpu-binding)"

step check bench 140 "$PY" bench/bench_gpu.py --out "$OUTDIR/gpu.json"
annotate "$(sed -n '/^=== \[bench\] .*timeout/,$p' "$LOG" | grep -E '^(no CUDA: skipped|ratio library/raw:|put (cuda_ipc|staged) )' | sed -E 's/ +/ /g' | tr '\n' ';')"

# rl_sync on the GPU (issue #15's headline): a colocated push of a 30B bf16 model from live weights
# into a direct-mode generator, next to a d2d copy of the same bytes and per-tensor CUDA IPC handles;
# then a 7B model in each mode with the generator's GPU memory. With what is left of the budget;
# DEVICE_CHECKS_RL_GPU=0 skips it. The headline holds two bf16 copies of its model (trainer and
# generator): 30B (~125 GiB) only where the GPU has more than 130 GB (an H200: run with
# kind="nvidia-h200"), else 13B (~52 GiB, fits an 80 GB H100), else 7B; DEVICE_CHECKS_RL_PARAMS_B
# sets it instead (the bench itself still scales it down, with the reason, if it does not fit).
if [ "${DEVICE_CHECKS_RL_GPU:-1}" != 0 ]; then
    if [ -n "${DEVICE_CHECKS_RL_PARAMS_B:-}" ]; then
        RL_B=$DEVICE_CHECKS_RL_PARAMS_B
        log "rl-gpu-bench headline: ${RL_B}B (DEVICE_CHECKS_RL_PARAMS_B)"
    else
        # (bounded by what is left of the budget: this runs outside any step)
        probe_s=$((BUDGET - (SECONDS - START) - GRACE - 20))
        [ "$probe_s" -gt 30 ] && probe_s=30
        GPU_MEM=0
        if [ "$probe_s" -ge 5 ]; then
            GPU_MEM=$(timeout -k 5 "$probe_s" "$PY" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0)' 2>/dev/null | tail -1)
        fi
        case "$GPU_MEM" in '' | *[!0-9]*) GPU_MEM=0 ;; esac
        GPU_GB=$((GPU_MEM / 1000000000))
        if [ "$GPU_GB" -gt 130 ]; then
            RL_B=30; why="the GPU has ${GPU_GB} GB > 130 GB: two bf16 copies of 30B (~125 GiB) fit"
        elif [ "$GPU_GB" -gt 70 ]; then
            RL_B=13; why="the GPU has ${GPU_GB} GB <= 130 GB: 30B's two bf16 copies (~125 GiB) do not fit, 13B's (~52 GiB) do; kind=\"nvidia-h200\" for 30B"
        elif [ "$GPU_GB" -gt 0 ]; then
            RL_B=7; why="the GPU has ${GPU_GB} GB <= 70 GB: 7B"
        else
            RL_B=30; why="no GPU memory read (no CUDA?): the bench decides"
        fi
        log "rl-gpu-bench headline: ${RL_B}B ($why)"
    fi
    step check rl-gpu-bench 200 "$PY" bench/bench_rl_gpu.py --reps 2 --params-b "$RL_B" --json "$OUTDIR/rl_gpu.json"
    annotate "$(sed -n '/^=== \[rl-gpu-bench\] .*timeout/,$p' "$LOG" | grep -E '^(SUMMARY rl_sync|FAILED rows)' | sed 's/^SUMMARY //' | tr '\n' ';')"
fi

# transport's tcp plane against a raw loopback socket (issue #2's "tcp put >= 0.9x raw socket"): on
# the 2-core CI VM a put costs 130-180 us more CPU time per op than a raw send (4 KiB, 1 MiB), and
# at 1-4 MiB it misses the target; this machine has 16 cores to overlap that work with the copies.
# CPU only (no GPU), 1-64 MiB, plus the CPU-time-per-op table; an info step.
# Off by default now (the GPU steps need the time); DEVICE_CHECKS_TCP=1 runs it.
if [ "${DEVICE_CHECKS_TCP:-0}" != 0 ]; then
    step info tcp-bench 90 "$PY" bench/bench_transport.py --only raw,tcp --max-mib 64 --rounds 2 --json "$OUTDIR/transport_tcp.json"
    annotate "$(sed -n '/^=== \[tcp-bench\] .*timeout/,$p' "$LOG" | awk '/(PASS|MISS) +tcp put/ {$1=$1; printf "%s;", $0} /^CPU per op: transport tcp put/ {printf " put %s %s: wall %s us, CPU %s us (%s %s vs raw);", $7, $8, $9, $12, $14, $15}')"
fi

# rl_sync's fan-out target (4 subscribers on one host <= 1.6x the time of 1): on the 2-core CI VM,
# where one core saturates memory bandwidth, only mode="shared" (no copy per subscriber) meets it;
# this machine has 16 cores, so the copying modes may too. CPU only, and only with what is left of
# the budget (an info step: it never fails the run).
# Off by default now (the GPU tests take that time); DEVICE_CHECKS_RL_SYNC=1 runs it.
if [ "${DEVICE_CHECKS_RL_SYNC:-0}" != 0 ]; then
    step info rl-sync-bench 150 "$PY" bench/bench_rl_sync.py --rounds 1 --reps 3 --json "$OUTDIR/rl_sync.json"
    annotate "$(sed -n '/^=== \[rl-sync-bench\] .*timeout/,$p' "$LOG" | grep -E 'fan-out t\(4\)/t\(1\)' | tr -s ' ' | tr '\n' ';')"
fi

# -- summary ---------------------------------------------------------------------------------------
log ""
log "=== summary ($((SECONDS - START))s of a ${BUDGET}s budget; files in $OUTDIR: $(cd "$OUTDIR" && ls | tr '\n' ' '))"
for line in "${SUMMARY[@]}"; do log "$line"; done
if [ "$FAILED" -eq 0 ]; then
    log "SUMMARY all check steps passed"
    exit 0
fi
log "SUMMARY $FAILED check step(s) failed"
exit 1
