#!/usr/bin/env bash
# The GPU check: one call on a machine with an NVIDIA GPU that reaches no package registry.
#
#   nox -s gpu_wheels     # once, on a machine that reaches one: fills gpu-wheels/ (~20 MB)
#   bash tests/gpu/run.sh # on the GPU machine, with gpu-wheels/ beside the checkout's files
#
# It builds the stack over the machine's own Python (its JAX with CUDA, flax, optax, orbax):
# a venv that sees that Python's packages, the carried wheels (the mpich wheel, mpi4py, the
# test tools), mpi4jax built from its carried sdist by the install recipe of docs/gpus.md,
# and this checkout on PYTHONPATH. Then, each under its own time limit, most telling first:
# jaxddp doctor, the digits example at 2, 4 and 1 ranks (and 1 with JAXDDP_COLLECTIVES=xla),
# the exactness check, the GPU
# benchmark (jaxddp's handlers, mpi4jax's, a world of one), the MPI test suite at 2 ranks on
# the GPU (join and checkpoints among it), and a checkpointed digits run resumed. Everything
# goes to $OUT (default ./gpu-report): report.md (a table of every check and the figures),
# steps.log (every check's output), and the benchmark's JSON files. It stops when BUDGET
# seconds (default 460) have passed, saying which checks it did not reach. Exit 0 when every
# check it ran passed. Rehearsed on a CPU machine with IMAGE_PYTHON (a Python with JAX),
# SUITE_PLATFORMS=cpu and BENCH_ARGS="--width 512 --layers 4 --batch 64".
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-report}
WHEELS=${JAXDDP_GPU_WHEELS:-$ROOT/gpu-wheels}
IMAGE_PYTHON=${IMAGE_PYTHON:-python3}
BUDGET=${BUDGET:-460}
V=${JAXDDP_GPU_VENV:-/tmp/jaxddp-gpu-venv}
mkdir -p "$OUT"
REPORT=$OUT/report.md
LOG=$OUT/steps.log
: >"$LOG"
failed=0

{
  echo "# jaxddp GPU check"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'), $(hostname)"
  echo
  echo '```'
  nvidia-smi -L 2>&1 | head -8
  echo "$(nproc) cores; image python: $($IMAGE_PYTHON --version 2>&1)"
  echo '```'
  echo
  echo "| check | result | seconds | figures |"
  echo "|---|---|---|---|"
} >"$REPORT"

# step NAME LIMIT COMMAND...: runs COMMAND (its output into steps.log) under LIMIT seconds,
# or less where the budget has less left; a row in the report. FIGURES, if set, is a command
# whose output goes into the row's last column.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - SECONDS))
  if ((left < 15)); then
    echo "| $name | not reached (budget spent) | | |" >>"$REPORT"
    failed=1
    return 1
  fi
  ((limit > left)) && limit=$left
  echo "=== $name ($(date -u +%T), limit ${limit}s): $*" >>"$LOG"
  local start=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >"$OUT/.step" 2>&1
  rc=$?
  cat "$OUT/.step" >>"$LOG"
  local figures=""
  if [[ -n ${FIGURES:-} ]]; then figures=$(bash -c "$FIGURES" <"$OUT/.step" 2>/dev/null | tr '\n' ' '); fi
  local result="pass"
  ((rc == 124 || rc == 137)) && result="TIMED OUT"
  ((rc != 0 && rc != 124 && rc != 137)) && result="FAIL (exit $rc)"
  echo "| $name | $result | $((SECONDS - start)) | ${figures} |" >>"$REPORT"
  ((rc != 0)) && failed=1
  return $rc
}

setup() {
  set -e
  rm -rf "$V"
  "$IMAGE_PYTHON" -m venv "$V"
  local site
  site=$("$IMAGE_PYTHON" -c "import site; print(site.getsitepackages()[0])")
  local mine
  mine=$("$V/bin/python" -c "import site; print(site.getsitepackages()[0])")
  echo "$site" >"$mine/image.pth"
  "$V/bin/pip" install --quiet --no-index --no-deps "$WHEELS"/*.whl
  # docs/gpus.md's recipe: the venv's MPI first in the compile and the link (and the CUDA
  # toolkit where an nvcc wrapper on PATH would hide it)
  if [[ -z ${CUDA_ROOT:-} && -f /usr/local/cuda/include/cuda_runtime.h ]]; then
    export CUDA_ROOT=/usr/local/cuda
  fi
  LDFLAGS="-L$V/lib -Wl,-rpath,$V/lib" CPPFLAGS="-I$V/include" MPI4JAX_BUILD_MPICC="$V/bin/mpicc" \
    "$V/bin/pip" install --quiet --no-build-isolation --no-index --no-deps --no-cache-dir \
    "$WHEELS"/mpi4jax-*.tar.gz
  "$V/bin/python" -c "import jax, mpi4jax; print('jax', jax.__version__, jax.devices())"
}

PY=$V/bin/python
MPIEXEC=$V/bin/mpiexec
export PYTHONPATH=$ROOT MPI4JAX_NO_WARN_JAX_VERSION=1 V WHEELS IMAGE_PYTHON
export -f setup
unset JAX_PLATFORMS
step setup 240 bash -c setup || {
  echo "setup failed: see steps.log" >>"$REPORT"
  exit 1
}
export PATH=$V/bin:$PATH

FIGURES="grep -E '^  collectives: |^  rank [0-9]: GPU|^verdict' | head -4" \
  step "doctor, 2 ranks" 60 "$MPIEXEC" -n 2 "$PY" -m jaxddp doctor

DIGITS="grep -E 'accuracy|identical' | sed -e 's/ (.*test images)//'"
FIGURES=$DIGITS step "digits, 2 ranks x 32" 120 "$MPIEXEC" -n 2 "$PY" -m jaxddp.examples.digits
FIGURES="grep -o '\"max_abs_diff_to_one_process\": [^,]*, \"identical_on_every_rank\": [a-z]*' | head -1" \
  step "exactness, 2 ranks, highest precision" 120 "$MPIEXEC" -n 2 "$PY" tests/gpu/exact.py --precision highest
FIGURES="grep -o '\"max_abs_diff_to_one_process\": [^,]*' | head -1" \
  step "exactness, 2 ranks, default precision (informational)" 120 "$MPIEXEC" -n 2 "$PY" tests/gpu/exact.py --precision default
BENCH="grep -oE '(with_sync_s|without_sync_s|sync_s|limit_s|ratio_to_limit|step_ratio) [0-9.]+( ms)?' | tr '\n' ' '"
FIGURES=$BENCH step "benchmark, 2 ranks, jaxddp's handlers" 150 \
  "$MPIEXEC" -n 2 "$PY" benchmarks/bench_gpu.py ${BENCH_ARGS:-} --out "$OUT/bench-np2.json"
FIGURES=$DIGITS step "digits, 4 ranks x 16" 150 "$MPIEXEC" -n 4 "$PY" -m jaxddp.examples.digits --batch-size 16
DIGEST="grep -E 'accuracy|identical|digest' | sed -e 's/ (.*test images)//' -e 's/final parameters: //'"
FIGURES=$DIGEST step "digits, 1 process x 64" 90 "$PY" -m jaxddp.examples.digits --batch-size 64
# JAX's own collectives (docs/xla.md): with one GPU, one process only (NCCL refuses two ranks
# on one GPU); its digest beside the row above's
FIGURES=$DIGEST step "digits, 1 process x 64, JAXDDP_COLLECTIVES=xla" 90 \
  env JAXDDP_COLLECTIVES=xla "$PY" -m jaxddp.examples.digits --batch-size 64
FIGURES="tail -3 | grep -E 'passed|failed'" \
  step "tests/mpi, 2 ranks, on the GPU" 300 env JAX_PLATFORMS="${SUITE_PLATFORMS:-cuda}" JAXDDP_TEST_NP=2 \
  "$PY" -m pytest tests/mpi -n 0 -q -p no:cacheprovider -k "not staged and not large_leaves and not xla"
FIGURES=$BENCH step "benchmark, 2 ranks, mpi4jax's handlers" 120 env JAXDDP_NATIVE_ALLREDUCE=0 \
  "$MPIEXEC" -n 2 "$PY" benchmarks/bench_gpu.py ${BENCH_ARGS:-} --out "$OUT/bench-np2-mpi4jax.json"
FIGURES=$BENCH step "benchmark, world of one" 90 "$PY" benchmarks/bench_gpu.py ${BENCH_ARGS:-} --out "$OUT/bench-np1.json"
CKPT=$(mktemp -d)
FIGURES=$DIGITS step "digits with checkpoints, 2 ranks, 3 epochs" 90 \
  "$MPIEXEC" -n 2 "$PY" -m jaxddp.examples.digits --epochs 3 --checkpoint-dir "$CKPT"
FIGURES=$DIGITS step "... resumed on 4 ranks to 5 epochs" 120 \
  "$MPIEXEC" -n 4 "$PY" -m jaxddp.examples.digits --epochs 5 --batch-size 16 --checkpoint-dir "$CKPT" --resume

rm -f "$OUT/.step"
echo >>"$REPORT"
echo "Overall: $([[ $failed == 0 ]] && echo 'every check passed' || echo 'some check failed or was not reached') in ${SECONDS} s." >>"$REPORT"
cat "$REPORT"
exit $failed
