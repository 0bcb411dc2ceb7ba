#!/usr/bin/env python3
"""Write the pytorch/xla pull request as a patch, and check that it applies.

The patch is ``git diff <base>..HEAD`` limited to the paths that belong
upstream (``upstream_base.json`` -> ``upstream_paths``), where ``<base>`` is
the commit that added the pristine upstream files.

  python scripts/make_upstream_patch.py                    # writes out/upstream.patch
  python scripts/make_upstream_patch.py --check ~/pytorch-xla   # + docs, git apply --check
"""

import argparse
import difflib
import os
import subprocess
import sys
import tempfile

from upstream_base import ROOT, base_commit, git, load_manifest


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

  manifest = load_manifest()
  base = base_commit()
  patch = git('diff', '--binary', f'{base}..HEAD', '--',
              *manifest['upstream_paths'])
  if args.check:
    patch += doc_patch(args.check, manifest.get('upstream_docs', {}))
  elif manifest.get('upstream_docs'):
    print('note: the documentation hunks need upstream\'s files; give '
          '--check PYTORCH_XLA to include them')
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


def doc_patch(repo: str, docs: dict) -> str:
  """Diff hunks inserting our sections into upstream docs (read at HEAD).

  Upstream's docs are not in the torch_xla wheel, hence not in the base:
  the section text lives in this repository and is placed at patch time.
  """
  hunks = []
  for path, spec in docs.items():
    try:
      old = git('show', f'HEAD:{path}', cwd=repo)
    except subprocess.CalledProcessError:
      sys.exit(f'error: {repo} has no {path} at HEAD')
    marker = spec['insert_before']
    if marker not in old:
      sys.exit(f'error: {path} in {repo} has no line "{marker}" to insert '
               'the section before; update upstream_base.json')
    with open(os.path.join(ROOT, spec['section'])) as f:
      section = f.read()
    i = old.index(marker)
    new = old[:i] + section + '\n' + old[i:]
    hunks.append(''.join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            fromfile=f'a/{path}',
            tofile=f'b/{path}')))
  return ''.join(f'diff --git a/{p} b/{p}\n' + h for p, h in zip(docs, hunks))


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
