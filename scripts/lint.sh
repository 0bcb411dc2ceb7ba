#!/usr/bin/env bash
# Upstream's lint: yapf 0.40.2 with .style.yapf (pytorch/xla's settings) on
# the Python files that follow upstream's style.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files 'torch_xla/*.py' 'test/*.py' 'benchmarks/*.py' 'scripts/*.py' \
  'torch_xla_fsdp_overlay/*.py' 'docs/experiments/*.py' 'setup.py')
if ! diff=$(yapf --diff $files); then
  echo "$diff"
  echo "yapf would reformat the files above: run yapf -i on them" >&2
  exit 1
fi
echo "yapf: $(echo $files | wc -w) files clean"
