#!/usr/bin/env python3
"""Execution time of the two ways to build a unit's flat gradient.

A unit of ``--params`` gradients of ``--size`` x ``--size`` floats becomes one
flat gradient either by one concatenation (what the series does) or by
writing each gradient over its slot of the unit-sized buffer in place,
``torch.as_strided_scatter`` after a barrier (an XLA DynamicUpdateSlice, what
``in-place-gradient-writes.patch`` does). Prints the median execution time
of each, over ``--steps`` steps after one warm-up step.

  PJRT_DEVICE=CPU python docs/experiments/gradient_writes.py
"""

import argparse
import os
import statistics
import sys
import time

# XLA reads its flags at its first compilation: keep the barriers on CPU
os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') +
    ' --xla_disable_hlo_passes=cse_barrier_expander')
import torch
import torch_xla
import torch_xla.core.xla_model as xm


def build(kind, gradients, size):
  numel = size * size
  if kind == 'concatenation':
    return torch.cat([(g * 2.0).reshape(-1) for g in gradients])
  flat = torch.zeros(len(gradients) * numel, device=gradients[0].device)
  for i, g in enumerate(gradients):
    ordered = [flat, g * 2.0]
    xm.optimization_barrier_(ordered)
    flat = torch.as_strided_scatter(ordered[0], ordered[1].reshape(-1),
                                    (numel,), (1,), i * numel)
  return flat


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--params', type=int, default=8)
  parser.add_argument('--size', type=int, default=1280)
  parser.add_argument('--steps', type=int, default=5)
  args = parser.parse_args()
  device = torch_xla.device()
  gradients = [
      torch.randn(args.size, args.size, device=device)
      for _ in range(args.params)
  ]
  torch_xla.sync()
  rows = []
  for kind in ('concatenation', 'in-place writes'):
    print(f'measuring {kind} ...', file=sys.stderr, flush=True)
    times = []
    for step in range(args.steps + 1):
      t0 = time.perf_counter()
      flat = build(kind, gradients, args.size)
      torch_xla.sync()
      xm.wait_device_ops()
      if step > 0:
        times.append(time.perf_counter() - t0)
    rows.append((kind, 1e3 * statistics.median(times)))
  elements = args.params * args.size * args.size
  print(f'\n{args.params} gradients of {args.size}x{args.size} floats, '
        f'{xm.xla_device_hw(device)}')
  print(f'{"flat gradient by":>16}  {"ms":>8}  {"ns per element":>14}')
  for kind, ms in rows:
    print(f'{kind:>16}  {ms:8.1f}  {1e6 * ms / elements:14.2f}')


if __name__ == '__main__':
  main()
