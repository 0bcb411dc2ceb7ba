#!/usr/bin/env python3
"""Write the pytorch/xla pull request as a patch, and check that it applies.

The patch is ``git diff <base>..HEAD`` limited to the paths that belong
upstream (``upstream_base.json`` -> ``upstream_paths``), where ``<base>`` is
the commit that added the pristine upstream files.

  python scripts/make_upstream_patch.py                    # writes out/upstream.patch
  python scripts/make_upstream_patch.py --check ~/pytorch-xla   # and git apply --check
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*args, cwd=ROOT) -> str:
  return subprocess.run(['git', '-C', cwd, *args],
                        check=True,
                        capture_output=True,
                        text=True).stdout


def base_commit() -> str:
  commits = git('log', '--diff-filter=A', '--format=%H', '--',
                'upstream_base.json').split()
  if not commits:
    sys.exit('error: upstream_base.json is not committed; no base to diff from')
  return commits[-1]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      '-o',
      '--output',
      default=os.path.join(ROOT, 'out', 'upstream.patch'),
      help='where to write the patch (default: out/upstream.patch)')
  parser.add_argument(
      '--check',
      metavar='PYTORCH_XLA',
      help='a pytorch/xla checkout to run `git apply --check` in')
  args = parser.parse_args()

  with open(os.path.join(ROOT, 'upstream_base.json')) as f:
    paths = json.load(f)['upstream_paths']
  base = base_commit()
  patch = git('diff', '--binary', f'{base}..HEAD', '--', *paths)
  os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
  with open(args.output, 'w') as f:
    f.write(patch)
  files = [l[6:] for l in patch.splitlines() if l.startswith('+++ b/')]
  print(f'base {base[:12]}..HEAD: {len(files)} file(s) changed, '
        f'{len(patch.splitlines())} patch lines -> {args.output}')
  for name in files:
    print(f'  {name}')

  if args.check:
    check_applies(args.check, args.output, bool(patch))


def check_applies(repo: str, patch_path: str, nonempty: bool) -> None:
  """``git apply --check`` in ``repo``; a bare repository is checked at HEAD."""
  try:
    bare = git('rev-parse', '--is-bare-repository', cwd=repo).strip()
    head = git('rev-parse', 'HEAD', cwd=repo).strip()
  except subprocess.CalledProcessError:
    sys.exit(f'error: {repo} is not a git checkout of pytorch/xla')
  if not nonempty:
    print(f'empty patch: applies trivially to {repo} at {head[:12]}')
    return
  with tempfile.TemporaryDirectory() as tmp:
    worktree = repo
    if bare == 'true':
      worktree = os.path.join(tmp, 'xla')
      git('worktree', 'add', '--detach', worktree, head, cwd=repo)
    try:
      result = subprocess.run([
          'git', '-C', worktree, 'apply', '--check', '-v',
          os.path.abspath(patch_path)
      ],
                              capture_output=True,
                              text=True)
    finally:
      if worktree != repo:
        git('worktree', 'remove', '--force', worktree, cwd=repo)
  if result.returncode != 0:
    sys.exit(f'error: the patch does not apply to {repo} at {head[:12]}:\n'
             f'{result.stderr}')
  print(f'git apply --check: the patch applies to {repo} at {head[:12]}')


if __name__ == '__main__':
  main()
