#!/bin/bash
# Runs this repository's tests the way upstream's test/run_tests.sh does: one
# process per test file, on one CPU device unless PJRT_DEVICE says otherwise
# (the TPU workflow sets PJRT_DEVICE=TPU).
set -eo pipefail

_TEST_DIR="$(cd "$(dirname "$0")" && pwd -P)"
cd "$_TEST_DIR"

export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
if [[ "$PJRT_DEVICE" == "CPU" ]]; then
  # Several CPU devices deadlock in collectives with torch_xla 2.9; world
  # sizes > 1 are simulated (fsdp_memory_utils.simulated_world_size).
  export CPU_NUM_DEVICES=1
fi

PASSED=0
FAILED=0
FAILED_FILES=()

# Runs one test file and adds its unittest counts ("Ran N tests", then "OK"
# or "FAILED (failures=F, errors=E)") to the totals; a file that dies before
# reporting counts as one failure.
function run_test {
  echo "Running ($PJRT_DEVICE): $*"
  local log
  log="$(mktemp)"
  local rc=0
  python3 "$@" 2>&1 | tee "$log" || rc=$?
  local ran bad
  ran=$(grep -oE '^Ran [0-9]+ test' "$log" | tail -1 | grep -oE '[0-9]+' || true)
  bad=0
  local n
  for n in $(grep -E '^FAILED \(' "$log" | tail -1 |
    grep -oE '(failures|errors|unexpected successes)=[0-9]+' | cut -d= -f2); do
    bad=$((bad + n))
  done
  rm -f "$log"
  if [[ -z "$ran" ]]; then
    FAILED=$((FAILED + 1))
    FAILED_FILES+=("$*")
    return
  fi
  if [[ "$rc" != 0 && "$bad" == 0 ]]; then
    bad=1
  fi
  PASSED=$((PASSED + ran - bad))
  FAILED=$((FAILED + bad))
  if [[ "$bad" != 0 ]]; then
    FAILED_FILES+=("$*")
  fi
}

function run_test_without_functionalization {
  echo "Running with XLA_DISABLE_FUNCTIONALIZATION=1: $*"
  XLA_DISABLE_FUNCTIONALIZATION=1 run_test "$@"
}

run_test test_fsdp_overlay.py
run_test test_fsdp_memory_measurement.py
run_test test_fsdp_flatten_memory.py
run_test_without_functionalization test_fsdp_flatten_memory.py
run_test test_fsdp_flatten_parity.py
run_test_without_functionalization test_fsdp_flatten_parity.py
run_test test_fsdp_flatten_features.py
run_test_without_functionalization test_fsdp_flatten_features.py
run_test test_fsdp_meta_init.py
run_test_without_functionalization test_fsdp_meta_init.py

echo
for t in "${FAILED_FILES[@]}"; do echo "FAILED: $t"; done
echo "tests: $PASSED passed, $FAILED failed"
[[ "$FAILED" == 0 ]]
