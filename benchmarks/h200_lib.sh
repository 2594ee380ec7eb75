# The shared start of the wave-3 GPU scripts (sourced, not run): shell options, the environment
# every part needs (the checkout on PYTHONPATH, fla's fixed configs), the output folder, and two
# helpers: `part TITLE` (a timestamped heading) and `shape LIMIT NAME ARGS...` (one
# `bench target` shape in its own process under its own time limit, JSON rows on stdout).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLA_CACHE_MODE=default FLA_CONFIG_DIR="$PWD/benchmarks/fla_configs"  # fixed fla configs
out=${OUT:-/tmp/dflash_bench/out}; mkdir -p "$out"
part() { echo; echo "== $1 ($(date +%T))"; }
shape() {  # limit, shape, then bench target arguments
  local limit=$1 name=$2; shift 2
  part "bench target $name $*"
  timeout "$limit" python3 -m dflash_async bench target --shapes "$name" --repeats 3 "$@" \
    2> >(grep -v '^\s*$' | tail -12 >&2) | grep '^{'
}
