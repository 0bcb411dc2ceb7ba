"""The pristine upstream base: its manifest and its commit in this repository."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, 'upstream_base.json')


def load_manifest() -> dict:
  with open(MANIFEST) as f:
    return json.load(f)


def git(*args, cwd=ROOT) -> str:
  return subprocess.run(['git', '-C', cwd, *args],
                        check=True,
                        capture_output=True,
                        text=True).stdout


def base_commit() -> str:
  """The commit that added the manifest: the pristine base."""
  commits = git('log', '--diff-filter=A', '--format=%H', '--',
                'upstream_base.json').split()
  if not commits:
    sys.exit('error: upstream_base.json is not committed; there is no base')
  return commits[-1]
