#!/usr/bin/env python3
"""Write the pytorch/xla contribution: a series of patches, or one patch.

The series lives in ``upstream/series/`` as ``git format-patch`` files of
the upstream paths (``upstream_base.json``) against the pristine base.
Every mode first applies it, in order, to the base and checks that it gives
exactly this checkout's upstream files.

  python scripts/make_upstream_patch.py                  # out/upstream.patch
  python scripts/make_upstream_patch.py --series DIR     # DIR/0001-*.patch ...
  python scripts/make_upstream_patch.py --check ~/pytorch-xla [--series DIR]

The single patch is the series squashed. Each patch also carries its lines
for upstream's docs and test runner (``upstream_inserts``: files that are
not in the torch_xla wheel, hence not in the base), which are left out
when it is applied to the base. With ``--check``, the series is applied
with ``git am --keep-non-patch`` (which keeps the ``[FSDP]`` of the titles)
to the HEAD of a pytorch/xla checkout instead, those lines made anew from
``upstream_inserts``, and what is written comes from there: write the
series with ``--check`` so that its patches carry them. Written patches
are authored by ``--author``, or else by git's ``user.name`` and
``user.email``. To change a patch: ``git am`` the series onto the base
(``--worktree DIR`` leaves such a repository), amend, and ``git
format-patch`` it back into ``upstream/series/``.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

from upstream_base import ROOT, base_commit, git, load_manifest

IDENTITY = ['-c', 'user.name=make_upstream_patch', '-c', 'user.email=none']


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      '-o',
      '--output',
      default=os.path.join(ROOT, 'out', 'upstream.patch'),
      help='where to write the single patch (default: out/upstream.patch)')
  parser.add_argument(
      '--series',
      metavar='DIR',
      help='write the series as git format-patch files to DIR instead')
  parser.add_argument(
      '--check',
      metavar='PYTORCH_XLA',
      help='a pytorch/xla checkout to apply the series to (git am at HEAD)')
  parser.add_argument(
      '--author',
      metavar='"NAME <EMAIL>"',
      help='the author of the patches written with --series (default: '
      'git config user.name and user.email)')
  parser.add_argument(
      '--worktree',
      metavar='DIR',
      help='keep the repository the series was applied in at DIR (with '
      '--check: a worktree of that checkout)')
  args = parser.parse_args()
  if args.series:
    args.author = args.author or git_identity()
    if not re.fullmatch(r'[^<>]+ <[^<>\s]+@[^<>\s]+>', args.author or ''):
      sys.exit('error: the patches need an author: pass --author "NAME '
               '<EMAIL>" or set git config user.name and user.email')

  manifest = load_manifest()
  inserts = manifest.get('upstream_inserts', {})
  patches = sorted(
      glob.glob(os.path.join(ROOT, manifest['upstream_series'], '*.patch')))
  if not patches:
    sys.exit(f"error: no patches in {manifest['upstream_series']}")
  with tempfile.TemporaryDirectory() as tmp:
    base_repo = os.path.join(tmp, 'base')
    make_base_repo(base_repo, manifest['upstream_paths'])
    apply_series(base_repo, patches, exclude=inserts, author=args.author)
    if args.worktree and not args.check:  # (kept even if it differs)
      shutil.copytree(base_repo, args.worktree, symlinks=True)
    check_tree(base_repo, manifest['upstream_paths'])
    print(f'{len(patches)} patches applied to the base give the checkout\'s '
          'upstream files')
    repo = base_repo
    if args.check:
      repo = os.path.abspath(args.worktree or os.path.join(tmp, 'xla'))
      git('worktree', 'add', '--detach', repo, 'HEAD', cwd=args.check)
      try:
        apply_series(
            repo, patches, inserts, exclude=inserts, author=args.author)
        head = git('rev-parse', '--short=12', f'HEAD~{len(patches)}', cwd=repo)
        print(f'git am: the series applies to {args.check} at {head.strip()}')
        write(repo, len(patches), args)
      finally:
        if not args.worktree:
          git('worktree', 'remove', '--force', repo, cwd=args.check)
    else:
      if args.series:
        print('note: the lines for upstream\'s ' + ', '.join(inserts) +
              ' need its files; give --check PYTORCH_XLA to include them')
      write(repo, len(patches), args)


def make_base_repo(repo: str, paths) -> None:
  """A git repository holding the base's files under ``paths``."""
  base = base_commit()
  git('init', '-q', repo, cwd=ROOT)
  for name in git('ls-tree', '-r', '--name-only', base, '--', *paths).split():
    path = os.path.join(repo, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
      f.write(
          subprocess.run(['git', '-C', ROOT, 'show', f'{base}:{name}'],
                         check=True,
                         capture_output=True).stdout)
  git('add', '-A', cwd=repo)
  git(*IDENTITY, 'commit', '-q', '-m', f'base ({base[:12]})', cwd=repo)


def apply_series(repo: str,
                 patches,
                 inserts=None,
                 exclude=(),
                 author=None) -> None:
  """``git am`` each patch, without its lines for the files in ``exclude``;
  with ``inserts``, amend each with its lines made anew; with ``author``,
  make it the author."""
  ends = {}  # where the previous patch's lines end, in each file
  for number, patch in enumerate(patches, 1):
    result = subprocess.run([
        'git', *IDENTITY, '-C', repo, 'am', '--quiet', '--keep-non-patch',
        *[f'--exclude={path}' for path in exclude], patch
    ],
                            capture_output=True,
                            text=True)
    if result.returncode != 0:
      sys.exit(f'error: {os.path.basename(patch)} does not apply:\n'
               f'{result.stdout}{result.stderr}')
    inserted = inserts and insert_lines(repo, number, inserts, ends)
    if inserted:
      git('add', '-A', cwd=repo)
    if inserted or author:
      git(*IDENTITY,
          'commit',
          '-q',
          '--amend',
          '--no-edit',
          *([f'--author={author}'] if author else []),
          cwd=repo)


def insert_lines(repo: str, number: int, inserts: dict, ends: dict) -> bool:
  """Add patch ``number``'s lines to upstream files; True if any changed."""
  changed = False
  added_tests = [
      os.path.basename(name) for name in git(
          'diff',
          '--name-only',
          '--diff-filter=A',
          'HEAD~1',
          'HEAD',
          '--',
          'test/test_*.py',
          cwd=repo).split()
  ]
  for path, spec in inserts.items():
    if 'text' in spec:
      with open(os.path.join(ROOT, spec['text'])) as f:
        parts = re.split(r'<!-- patch (\d+) -->\n', f.read())
      text = dict(zip(map(int, parts[1::2]), parts[2::2])).get(number, '')
      text = text.strip('\n') + '\n\n' if text.strip() else ''
    else:
      text = ''.join(
          line.format(test=test) + '\n'
          for test in added_tests
          for line in spec['for_each_test_a_patch_adds'])
    if not text:
      continue
    full = os.path.join(repo, path)
    if not os.path.isfile(full):
      sys.exit(f'error: the checkout has no {path}')
    with open(full) as f:
      old = f.read()
    # A patch that applies on its own has a place of its own, out of reach
    # of the other patches' context lines.
    own = spec.get('after_for_patch', {}).get(str(number))
    marker = own or spec.get('before') or spec['after']
    if old.count(marker) != 1:
      sys.exit(f'error: {path} has not exactly one "{marker.strip()}" to '
               'insert at; update upstream_base.json')
    i = old.index(marker)
    if own:
      i += len(marker)
    elif 'after' in spec:
      # (after the marker: after what the earlier patches put there)
      i = ends.get(path, i + len(marker))
    with open(full, 'w') as f:
      f.write(old[:i] + text + old[i:])
    if not own:
      ends[path] = i + len(text)
    changed = True
  return changed


def git_identity():
  """git's ``user.name <user.email>`` in this checkout, or None."""
  try:
    return (f"{git('config', 'user.name').strip()} "
            f"<{git('config', 'user.email').strip()}>")
  except subprocess.CalledProcessError:
    return None


def check_tree(repo: str, paths) -> None:
  """The upstream files in ``repo`` are this checkout's, byte for byte."""
  ours = set(git('ls-files', '--', *paths).split())
  theirs = set(git('ls-files', '--', *paths, cwd=repo).split())
  problems = [f'  only in the checkout: {n}' for n in sorted(ours - theirs)]
  problems += [f'  only in the series: {n}' for n in sorted(theirs - ours)]
  for name in sorted(ours & theirs):
    with open(os.path.join(ROOT, name),
              'rb') as a, open(os.path.join(repo, name), 'rb') as b:
      if a.read() != b.read():
        problems.append(f'  differs: {name}')
  if problems:
    sys.exit('error: the series applied to the base is not the checkout; '
             'update upstream/series (see --help):\n' + '\n'.join(problems))


def write(repo: str, count: int, args) -> None:
  if args.series:
    os.makedirs(args.series, exist_ok=True)
    names = git(
        'format-patch',
        '-o',
        os.path.abspath(args.series),
        f'HEAD~{count}',
        cwd=repo).split()
    print(f'wrote {len(names)} patches to {args.series}:')
    for name, i in zip(names, range(count - 1, -1, -1)):
      stat = git('show', '--shortstat', '--format=', f'HEAD~{i}', cwd=repo)
      print(f'  {os.path.basename(name)}: {stat.strip()}')
    return
  patch = git('diff', '--binary', f'HEAD~{count}', 'HEAD', cwd=repo)
  os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
  with open(args.output, 'w') as f:
    f.write(patch)
  files = [l[6:] for l in patch.splitlines() if l.startswith('+++ b/')]
  print(f'the series squashed: {len(files)} file(s) changed, '
        f'{len(patch.splitlines())} patch lines -> {args.output}')
  for name in files:
    print(f'  {name}')


if __name__ == '__main__':
  main()
