#!/bin/bash
# Runs this repository's tests the way upstream's test/run_tests.sh does: one
# process per test file, on one CPU device unless PJRT_DEVICE says otherwise
# (the TPU workflow sets PJRT_DEVICE=TPU).
#
# On CPU, TEST_JOBS files (default: one per core) run at a time, each in a
# process and on a device of its own; each file's output is printed, in the
# order below, once all have ended. A TPU is opened by one process at a time,
# so there they run one by one.
set -eo pipefail

_TEST_DIR="$(cd "$(dirname "$0")" && pwd -P)"
cd "$_TEST_DIR"

export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
if [[ "$PJRT_DEVICE" == "CPU" ]]; then
  # Several CPU devices deadlock in collectives with torch_xla 2.9; world
  # sizes > 1 are simulated (fsdp_simulation.simulated_world_size).
  export CPU_NUM_DEVICES=1
  TEST_JOBS="${TEST_JOBS:-$(nproc)}"
else
  TEST_JOBS=1
fi

_LOGS="$(mktemp -d)"
trap 'rm -rf "$_LOGS"' EXIT
_STARTED=0

# run_test [NAME=VALUE ...] FILE [ARGS ...]: runs FILE with python3 (and
# those environment variables) once fewer than TEST_JOBS files are running.
function run_test {
  while (($(jobs -rp | wc -l) >= TEST_JOBS)); do
    wait -n || true
  done
  local log
  log="$_LOGS/$(printf %03d "$_STARTED")"
  _STARTED=$((_STARTED + 1))
  local vars=()
  while [[ "$1" == *=* ]]; do
    vars+=("$1")
    shift
  done
  echo "${vars[*]}${vars[*]:+ }$*" >"$log.name"
  (
    rc=0
    env "${vars[@]}" python3 "$@" >"$log" 2>&1 || rc=$?
    echo "$rc" >"$log.rc"
  ) &
}

function run_test_without_functionalization {
  run_test XLA_DISABLE_FUNCTIONALIZATION=1 "$@"
}

# Longest first, so that the last to start are short.
run_test test_fsdp_flatten_features.py
run_test_without_functionalization test_fsdp_flatten_features.py
run_test test_fsdp_flatten_memory.py
run_test test_fsdp_compiler_memory.py
run_test test_fsdp_flatten_vs_stock.py
run_test test_fsdp_memory_measurement.py

# The tests that go upstream, with and without functionalization.
for test in test_fsdp_flatten_parity.py test_fsdp_flatten_freed_params.py \
  test_fsdp_coalesce_all_gathers.py test_fsdp_meta_init.py test_fsdp_input_checks.py \
  test_fsdp_backward_regather.py test_fsdp_bucketed_reduce_scatter.py \
  test_fsdp_flatten_predivide.py; do
  run_test "$test"
  run_test_without_functionalization "$test"
done

# This repository's own: the Hugging Face Trainer, the overlay, the package
# users install and the series of upstream patches (the memory figures and the
# comparison with stock torch_xla are above).
run_test test_fsdp_hf_trainer.py
run_test test_fsdp_package.py
run_test test_fsdp_overlay.py
run_test test_upstream_series.py
wait

# Adds each file's unittest counts ("Ran N tests", then "OK" or "FAILED
# (failures=F, errors=E)") to the totals; a file that dies before reporting
# counts as one failure.
PASSED=0
FAILED=0
FAILED_FILES=()
for name in "$_LOGS"/*.name; do
  log="${name%.name}"
  echo "Running ($PJRT_DEVICE): $(cat "$name")"
  cat "$log"
  rc="$(cat "$log.rc")"
  ran=$(grep -oE '^Ran [0-9]+ test' "$log" | tail -1 | grep -oE '[0-9]+' || true)
  bad=0
  for n in $(grep -E '^FAILED \(' "$log" | tail -1 |
    grep -oE '(failures|errors|unexpected successes)=[0-9]+' | cut -d= -f2); do
    bad=$((bad + n))
  done
  if [[ -z "$ran" ]]; then
    FAILED=$((FAILED + 1))
    FAILED_FILES+=("$(cat "$name")")
    continue
  fi
  if [[ "$rc" != 0 && "$bad" == 0 ]]; then
    bad=1
  fi
  PASSED=$((PASSED + ran - bad))
  FAILED=$((FAILED + bad))
  if [[ "$bad" != 0 ]]; then
    FAILED_FILES+=("$(cat "$name")")
  fi
done

echo
for t in "${FAILED_FILES[@]}"; do echo "FAILED: $t"; done
echo "tests: $PASSED passed, $FAILED failed"
[[ "$FAILED" == 0 ]]
