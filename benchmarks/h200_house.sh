#!/usr/bin/env bash
# Issue 17 on one H200 (~4 min): the GPU tests touched by issue 17 (flex vs sdpa with derived bf16
# tolerances, strict capture of the whole step with torch's foreach clip_grad_norm_, the captured
# clip + AdamW replay), then the flex-vs-sdpa test on two purpose-made mutants of the flex mask,
# each run on a scratch copy of the tree: both must FAIL ("caught"). Prints one line per run.
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(pwd)
python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_drafter.py \
  "tests/model/test_optim.py::test_captured_clip_and_adamw_step_follow_the_schedule_without_recapture" \
  2>&1 | grep -E '^\{|passed|failed|Error' | tail -8

mutant() {  # name, file, text, replacement: "caught" when the flex-vs-sdpa test fails on it
  local scratch
  scratch=$(mktemp -d)
  cp -r "$root/dflash_async" "$root/tests" "$root/pyproject.toml" "$scratch/"
  python3 - "$scratch/$2" "$3" "$4" <<'EOF'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert old in text, old
open(path, "w").write(text.replace(old, new, 1))
EOF
  if (cd "$scratch" && python3 -m pytest -q -p no:cacheprovider \
      "tests/test_gpu_drafter.py::test_flex_path_matches_sdpa_reference_in_bf16" >/dev/null 2>&1); then
    echo "{\"mutant\": \"$1\", \"result\": \"MISSED\"}"
  else
    echo "{\"mutant\": \"$1\", \"result\": \"caught\"}"
  fi
  rm -rf "$scratch"
}
mutant context_includes_the_anchor_row dflash_async/model/attention_rule.py \
  "(kv_idx < q_hi)" "(kv_idx <= q_hi)"
mutant block_sees_the_next_slot dflash_async/model/attention_rule.py \
  "(kv_idx < q_block + B)" "(kv_idx < q_block + B + 1)"
