#!/usr/bin/env python3
"""Rewrite a traced step as it would be if torch_xla took its ordering token
out of each pinned all-gather through an optimization barrier.

torch_xla chains its collectives with a numeric token, a zero added to each
collective's input and renewed from its result. A pinned all-gather is an
all-reduce of ``(zero-padded shard, token)`` whose second result is the new
token; XLA:GPU makes the all-reduce's results one buffer, data and token, and
slices the token out of it where the next collective reads it. For a unit
gathered again for backward that is the unit's reduce-scatter, so the whole
gathered unit stays allocated through the unit's backward. Here each such
all-reduce's two results go through one ``opt-barrier`` that every use reads,
which is what a barrier in torch_xla's pinned all-reduce lowering would emit:
the slice is then made at the gather.

  python docs/experiments/token_barrier.py STEP.hlo.txt OUT.hlo.txt

STEP: a step traced by ``benchmarks/fsdp_compiler_memory.py`` (pinned).
Prints how many all-reduces it changed; compile OUT with that file's
``compile_hlo``.
"""

import re
import sys

# an all-reduce of (data, token), torch_xla's pinned all-gather
_ALL_REDUCE = re.compile(r'^\s+%(all-reduce\.\d+) = \((\S+), f32\[\]\) '
                         r'all-reduce\(')
_ELEMENT = re.compile(r'^\s+%(\S+) = \S+ get-tuple-element\('
                      r'%(all-reduce\.\d+)\), index=([01])\b')


def with_token_barriers(hlo_text):
  lines = hlo_text.split('\n')
  if '%tb' in hlo_text:
    raise ValueError('the step already has instructions named %tb...')
  elements = {}  # all-reduce: {index: its get-tuple-element}
  for line in lines:
    m = _ELEMENT.match(line)
    if m:
      index = elements.setdefault(m.group(2), {})
      if int(m.group(3)) in index:
        raise ValueError(f'{m.group(2)}: two get-tuple-elements of one result')
      index[int(m.group(3))] = m.group(1)
  out, renamed = [], {}
  for line in lines:
    out.append(line)
    m = _ALL_REDUCE.match(line)
    if m is None or len(elements.get(m.group(1), {})) != 2:
      continue
    ar, data = m.group(1), m.group(2)
    n = len(renamed) // 2
    out += [
        f'  %tb_data.{n} = {data} get-tuple-element(%{ar}), index=0',
        f'  %tb_token.{n} = f32[] get-tuple-element(%{ar}), index=1',
        f'  %tb_tuple.{n} = ({data}, f32[]) tuple(%tb_data.{n}, '
        f'%tb_token.{n})',
        f'  %tb.{n} = ({data}, f32[]) opt-barrier(%tb_tuple.{n})',
        f'  %tb_data_out.{n} = {data} get-tuple-element(%tb.{n}), index=0',
        f'  %tb_token_out.{n} = f32[] get-tuple-element(%tb.{n}), index=1',
    ]
    renamed[elements[ar][0]] = f'tb_data_out.{n}'
    renamed[elements[ar][1]] = f'tb_token_out.{n}'
  if not renamed:
    return hlo_text, 0
  use = re.compile(r'%(' + '|'.join(map(re.escape, renamed)) + r')(?=[,)\s])')
  for i, line in enumerate(out):
    name, sep, rest = line.partition(' = ')
    if sep:  # (each use; the old elements stay, unused)
      out[i] = name + sep + use.sub(lambda m: '%' + renamed[m.group(1)], rest)
  return '\n'.join(out), len(renamed) // 2


def main():
  if len(sys.argv) != 3:
    sys.exit(__doc__)
  with open(sys.argv[1]) as f:
    text, changed = with_token_barriers(f.read())
  with open(sys.argv[2], 'w') as f:
    f.write(text)
  print(f'{changed} all-reduces with their token behind a barrier')


if __name__ == '__main__':
  main()
