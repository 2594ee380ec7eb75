# Shared start of benchmarks/gpu.sh (sourced, not run): shell options, the environment every part
# needs, the output folder and a few small functions.
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$PWD
out=${OUT:-out}
work=${WORK:-/tmp/dflash_bench}
mkdir -p "$out" "$work"
out=$(cd "$out" && pwd)

# Optional offline install: wheels in $WHEELS (default .whl/) go into $SITE without touching the
# network, for machines that cannot reach a package index. All of them in one pip call: packages
# that share a top folder (flash-attn-4's CuTe DSL) must be installed together.
site=${SITE:-/tmp/site}
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" > /dev/null && [ ! -f "$site/.installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl && touch "$site/.installed"
fi
# The repository on the path (benchmarks/research imports dflash_async from it); the CuTe DSL's
# `cutlass` package sits in a folder that a .pth file adds, and PYTHONPATH folders run no .pth
# files, so it is named here.
path=$root
[ -d "$site" ] && path=$path:$site
[ -d "$site/nvidia_cutlass_dsl/dsl_packages" ] && path=$path:$site/nvidia_cutlass_dsl/dsl_packages
export PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH}
# flash-linear-attention's kernels with one fixed config each (7 compiles per shape instead of
# autotuning 75 configs); unset both to let fla tune.
export FLA_CACHE_MODE=${FLA_CACHE_MODE-default} FLA_CONFIG_DIR=${FLA_CONFIG_DIR-$root/benchmarks/fla_configs}

part() { echo; echo "== $1 ($(date +%T))"; }

# limit, then a command: run it under its own time limit, so one slow step cannot starve the rest
limited() { local limit=$1; shift; timeout "$limit" "$@"; echo "rc=$?"; }

# NAME, then pytest arguments: verbose pytest output and the 15 slowest tests straight into
# $out/NAME.txt (a cut run still names what failed), its summary line on stdout; under
# TESTS_TIMEOUT (default 560 s), each GPU test's peak reserved memory into
# $out/gpu_test_memory.jsonl (tests/conftest.py)
gpu_pytest() {
  local name=$1; shift
  DFLASH_TEST_GPU_MEMORY="$out/gpu_test_memory.jsonl" timeout "${TESTS_TIMEOUT:-560}" \
    python3 -m pytest -v -p no:cacheprovider --durations=15 "$@" > "$out/$name.txt" 2>&1
  echo "pytest $name rc=$?: $(tail -1 "$out/$name.txt")"
}

# limit, then `bench drafter` arguments (the Qwen3-8B drafter shape, compiled, graph-replayed)
drafter() {
  local limit=$1; shift
  part "bench drafter $*"
  timeout "$limit" python3 -m dflash_async bench drafter --shape qwen3-8b --compile --modes graph \
    "$@" 2>> "$out/bench_drafter.err" | tee -a "$out/bench_drafter.jsonl"
}

# limit, then `bench target` arguments (three timed calls after a first)
target() {
  local limit=$1; shift
  part "bench target $*"
  timeout "$limit" python3 -m dflash_async bench target --repeats 3 "$@" \
    2>> "$out/bench_target.err" | tee -a "$out/bench_target.jsonl"
}

# The Qwen3-8B-shaped random bf16 target and 4,000 synthetic pre-tokenized samples, written once
random_target() {
  [ -d "$work/qwen3-8b-random" ] || python3 benchmarks/make_random_target.py "$work"
}

# NAME, then DFLASH_* settings: `python -m dflash_async run` on the random Qwen3-8B target with
# the one-GPU preset; its log in $out/NAME.log
pipeline_run() {
  local name=$1; shift
  rm -rf "${work:?}/$name"
  env DFLASH_ENV_FILE=settings/qwen3_8b_1xh200.env DFLASH_TARGET__PATH="$work/qwen3-8b-random" \
    DFLASH_DATA__PATH="$work/synthetic.jsonl" DFLASH_TRAIN__SAVE_EVERY=0 DFLASH_EVAL__EVERY=0 \
    DFLASH_EVAL__AT_END=false DFLASH_LOG__FORMAT=json DFLASH_OUTPUT_DIR="$work/$name" "$@" \
    timeout "${RUN_TIMEOUT:-590}" python3 -m dflash_async run > "$out/$name.log" 2> "$out/$name.err"
  echo "run $name rc=$?"
  grep -E '"(placement|target_path_chosen|drafter_kernels_chosen|startup_completed|run_summary|run_failed)"' \
    "$out/$name.log" | cut -c1-700
  tail -3 "$out/$name.err"
}
