#!/usr/bin/env python3
"""What the TPU compiler keeps of a flat gradient that it reduce-scatters:
eight 4 MiB matmul gradients made one flat buffer, then reduce-scattered at
world size 8 (the TPU compiler lowers that to an all-reduce of the whole
buffer and a slice of it), as a flatten_parameters=True unit's backward
does, in three forms:

  concatenate  a concatenation, the fixed FSDP's (torch.cat)
  divide       the concatenation divided by a factor first, as the
               post-backward hook's gradient_predivide_factor does
  padsum       the sum of the gradients, each zero-padded to its place
               (the sweep's grad=padsum): one elementwise op

Prints, per form and TPU generation, the compiler's total and what is live
at its peak, with the buffers of the flat buffer's size. By default the
compiler may place buffers on chip; --no-on-chip (``--xla_msa_enable=false``
in LIBTPU_INIT_ARGS) keeps every buffer in HBM.

  python docs/experiments/concatenate_then_reduce_scatter.py [--no-on-chip]
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)), '..', '..', 'benchmarks'))
import fsdp_compiler_memory as cm

N, K = 8, 1024  # eight [K, K] gradients


def module(form: str) -> str:
  flat = N * K * K
  lines = [
      f'HloModule {form}, replica_count=8', '', 'add {',
      '  a = f32[] parameter(0)', '  b = f32[] parameter(1)',
      '  ROOT s = f32[] add(a, b)', '}', '', 'ENTRY main {',
      f'  x = f32[{K},{K}] parameter(0)',
      f'  factor = f32[] parameter({N + 1})', '  zero = f32[] constant(0)'
  ]
  for i in range(N):
    lines += [
        f'  w{i} = f32[{K},{K}] parameter({i + 1})',
        f'  g{i} = f32[{K},{K}] dot(x, w{i}), lhs_contracting_dims={{1}}, '
        'rhs_contracting_dims={0}', f'  r{i} = f32[{K * K}] reshape(g{i})'
    ]
  if form == 'padsum':
    for i in range(N):
      lines.append(f'  pad{i} = f32[{flat}] pad(r{i}, zero), '
                   f'padding={i * K * K}_{(N - 1 - i) * K * K}')
    lines.append(f'  sum1 = f32[{flat}] add(pad0, pad1)')
    for i in range(2, N):
      lines.append(f'  sum{i} = f32[{flat}] add(sum{i - 1}, pad{i})')
    grad = f'sum{N - 1}'
  else:
    lines.append(f'  cat = f32[{flat}] concatenate('
                 f"{', '.join(f'r{i}' for i in range(N))}), dimensions={{0}}")
    grad = 'cat'
  if form == 'divide':
    lines += [
        f'  factors = f32[{flat}] broadcast(factor), dimensions={{}}',
        f'  divided = f32[{flat}] divide(cat, factors)'
    ]
    grad = 'divided'
  lines += [
      f'  ROOT shard = f32[{K * K}] reduce-scatter({grad}), '
      'replica_groups={}, dimensions={0}, to_apply=add', '}', ''
  ]
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--no-on-chip', action='store_true')
  parser.add_argument(
      '--targets', nargs='+', default=['tpu-v5e', 'tpu-v4', 'tpu-v5p'])
  args = parser.parse_args()
  if args.no_on_chip:
    os.environ['LIBTPU_INIT_ARGS'] = (
        os.environ.get('LIBTPU_INIT_ARGS', '') + ' --xla_msa_enable=false')
  flat_bytes = 4 * N * K * K
  rows = [('form', 'target', 'total MB', 'live MB', 'flat-sized buffers')]
  with tempfile.TemporaryDirectory() as tmp:
    for form in ('concatenate', 'divide', 'padsum'):
      path = os.path.join(tmp, f'{form}.hlo.txt')
      with open(path, 'w') as f:
        f.write(module(form))
      for target in args.targets:
        dump = os.path.join(tmp, f'{form}-{target}')
        stats = cm.compile_hlo(path, target, dump_to=dump)
        peak = cm.explain(dump)
        big = [b['buffer'] for b in peak['buffers'] if b['bytes'] >= flat_bytes]
        rows.append(
            (form, target, f"{stats['total_bytes'] / cm.MB:.1f}",
             f"{peak['peak_bytes'] / cm.MB:.1f}", ', '.join(big) or '-'))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  for r in rows:
    print('  '.join(f'{c:<{w}}' for c, w in zip(r, widths)))


if __name__ == '__main__':
  main()
