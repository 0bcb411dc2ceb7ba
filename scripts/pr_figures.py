#!/usr/bin/env python3
"""The figures of the pull-request texts, made from the compiler report's JSON.

A table in a text of ``upstream/prs/`` sits between ``<!-- figures: NAME -->``
and ``<!-- /figures -->``, NAME one of ``TABLES``; its rows are made from
``upstream/pr_figures.json``, so that no figure in a text is typed by hand
and no two texts disagree. That file holds compiler reports
(``benchmarks/fsdp_compiler_memory.py --json``) of the #5464 model at 2
layers, Llama and T5, each record tagged with the ``tree`` it measured:
``series`` (F, stock T, and fixed T of the whole series), and ``patch 3``
and ``patch 4`` (fixed T with the series applied up to that patch: its FSDP
files copied into the checkout while measuring).

  python scripts/pr_figures.py            # rewrites the tables
  python scripts/pr_figures.py --check    # exit 1 where a text is out of date
"""

import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = os.path.join(ROOT, 'upstream', 'pr_figures.json')
PRS = os.path.join(ROOT, 'upstream', 'prs')
MB = 1e6
MODELS = {
    'report': '#5464 model (2 layers)',
    'llama': 'Llama',
    't5': 'T5',
}
TARGETS = {'tpu-v5e': 'TPU v5e', 'tpu-v4': 'TPU v4'}
_TABLE_RE = re.compile(r'(<!-- figures: (\w+) -->\n)(.*?)(<!-- /figures -->)',
                       re.S)


def _find(results):
  return {
      (r['tree'], r['model'], r['target'], r['variant']): r for r in results
  }


def _mb(record):
  return f"{record['total_bytes'] / MB:.1f}"


def _units(results, tree, model, target, reference=('series', 'F')):
  """(fixed T of ``tree`` - the reference) in units: the largest flat
  parameter the fixed step gathers."""
  find = _find(results)
  fixed = find[(tree, model, target, 'fixed T')]
  ref = find[(reference[0], model, target, reference[1])]
  return ((fixed['total_bytes'] - ref['total_bytes']) /
          fixed['largest_gather_bytes'])


def _table(header, cell):
  """A table with a row per model and a column per target, headed
  ``TARGET: header``, its cells ``cell(results, model, target)``."""

  def table(results):
    lines = [
        '| model | ' +
        ' | '.join(f'{name}: {header}' for name in TARGETS.values()) + ' |',
        '|---|' + '---|' * len(TARGETS)
    ]
    for model, name in MODELS.items():
      cells = [cell(results, model, target) for target in TARGETS]
      lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines) + '\n'

  return table


def _memory_cell(results, model, target):
  """F / before / after patch 3 (MB), and units above F."""
  find = _find(results)
  f, before = (find[('series', model, target, v)] for v in ('F', 'stock T'))
  after = find[('patch 3', model, target, 'fixed T')]
  return (f'{_mb(f)} / {_mb(before)} / {_mb(after)} '
          f"({_units(results, 'patch 3', model, target):.2f})")


def _step_cell(before_tree, after_tree):
  """fixed T before / after a patch (MB), and units above F."""

  def cell(results, model, target):
    a, b = (
        _find(results)[(tree, model, target, 'fixed T')]
        for tree in (before_tree, after_tree))
    return (f'{_mb(a)} / {_mb(b)} '
            f'({_units(results, before_tree, model, target):.2f} / '
            f'{_units(results, after_tree, model, target):.2f})')

  return cell


def _bytes_cell(before_tree, after_tree):
  """The bytes a step reads and writes (the compiler's cost analysis, MB)
  before / after a patch, and their ratio."""

  def cell(results, model, target):
    a, b = (
        _find(results)[(tree, model, target, 'fixed T')]['bytes_accessed']
        for tree in (before_tree, after_tree))
    return f'{a / MB:.0f} / {b / MB:.0f} ({b / a:.2f})'

  return cell


TABLES = {
    'memory':
        _table('F / before / after (units above F)', _memory_cell),
    'copy_out':
        _table('before / after (units above F)',
               _step_cell('patch 3', 'patch 4')),
    'copy_out_bytes':
        _table('before / after (after / before)',
               _bytes_cell('patch 3', 'patch 4')),
    'predivide':
        _table('before / after (units above F)',
               _step_cell('patch 4', 'series')),
}


def render(text, results):
  """``text`` with each of its tables made anew."""

  def table(match):
    head, name, _, tail = match.groups()
    if name not in TABLES:
      raise SystemExit(f'error: no table {name!r} (one of {", ".join(TABLES)})')
    return head + TABLES[name](results) + tail

  return _TABLE_RE.sub(table, text)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      '--check',
      action='store_true',
      help='change nothing; exit 1 if a text differs from its figures')
  args = parser.parse_args(argv)
  with open(FIGURES) as f:
    results = json.load(f)
  stale = []
  for path in sorted(glob.glob(os.path.join(PRS, '*.md'))):
    with open(path) as f:
      text = f.read()
    new = render(text, results)
    if new != text:
      stale.append(os.path.relpath(path, ROOT))
      if not args.check:
        with open(path, 'w') as f:
          f.write(new)
  for path in stale:
    print(f"{'out of date' if args.check else 'rewrote'}: {path}")
  return 1 if args.check and stale else 0


if __name__ == '__main__':
  sys.exit(main())
