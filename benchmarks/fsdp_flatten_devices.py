#!/usr/bin/env python3
"""Memory and step time on real devices: stock vs patched FSDP.

Trains the model of pytorch/xla#5464 (``--layers`` layers, one FSDP unit
each) with stock and patched FSDP, flatten_parameters False and True, on all
local devices: one process per device (``torch_xla.launch``), real
collectives, no simulation. Reports each configuration's peak device memory
(``xm.get_memory_info()``, the largest over the devices) and step time (the
median step after two warm-up steps, the slowest device). Every
configuration runs in a process of its own, stock torch_xla with
TORCH_XLA_FSDP_OVERLAY=0.

This is the TPU workflow's evidence. The CPU client keeps no allocator
statistics, so on CPU it reports step times only, on one device: there,
benchmarks/fsdp_flatten_memory.py measures memory from XLA's buffer
assignment.

  PJRT_DEVICE=TPU python benchmarks/fsdp_flatten_devices.py --out out/report-tpu
  python benchmarks/fsdp_flatten_devices.py --layers 2 --steps 4   # CPU

Writes report.json to --out (default out/report-devices).
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault('PJRT_DEVICE', 'CPU')
if os.environ['PJRT_DEVICE'].upper() == 'CPU':
  # several CPU devices deadlock in collectives with torch_xla 2.9
  os.environ.setdefault('CPU_NUM_DEVICES', '1')
TEST_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), '..', 'test')
VARIANTS = [('stock', False), ('stock', True), ('patched', False),
            ('patched', True)]
MB = 1e6


def label(build, flatten):
  return f"{build} flatten={'True' if flatten else 'False'}"


def train_on_device(index, layers, flatten, steps, out_dir):
  """One process per device: train, then write this rank's figures."""
  sys.path.insert(0, TEST_DIR)
  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm
  import torch_xla.runtime as xr
  import torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel as fsdp
  # (it has XLA dump the graphs, to a folder it removes at exit)
  from fsdp_memory_utils import BATCH, HIDDEN, wrap_report_model

  device = torch_xla.device()
  model = wrap_report_model(layers, flatten_parameters=flatten)
  optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
  times = []
  for _ in range(steps):
    x = torch.randn(BATCH, HIDDEN, device=device)
    t0 = time.perf_counter()
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()
    torch_xla.sync()
    xm.wait_device_ops()
    times.append(time.perf_counter() - t0)
  try:
    memory = xm.get_memory_info(device)
  except RuntimeError:  # (no allocator statistics, e.g. on CPU)
    memory = {}
  rank = xr.global_ordinal()
  with open(os.path.join(out_dir, f'rank{rank}.json'), 'w') as f:
    json.dump(
        {
            'rank': rank,
            'world_size': xr.world_size(),
            'device_type': xr.device_type(),
            'step_seconds': statistics.median(times[2:] or times),
            'peak_bytes': memory.get('peak_bytes_used'),
            'bytes_limit': memory.get('bytes_limit'),
            'fsdp_file': fsdp.__file__,
        }, f)


def measure(build, flatten, layers, steps):
  """Run one configuration on all local devices, in a fresh process."""
  with tempfile.TemporaryDirectory() as out_dir:
    args = [
        sys.executable,
        os.path.abspath(__file__), '--worker', out_dir, '--layers',
        str(layers), '--flatten',
        str(int(flatten)), '--steps',
        str(steps)
    ]
    env = dict(
        os.environ, TORCH_XLA_FSDP_OVERLAY='0' if build == 'stock' else '1')
    result = subprocess.run(args, env=env, capture_output=True, text=True)
    ranks = []
    for path in sorted(glob.glob(os.path.join(out_dir, 'rank*.json'))):
      with open(path) as f:
        ranks.append(json.load(f))
  if result.returncode != 0 or not ranks:
    return {'error': result.stderr[-2000:]}
  peaks = [r['peak_bytes'] for r in ranks if r['peak_bytes'] is not None]
  return {
      'devices': len(ranks),
      'world_size': ranks[0]['world_size'],
      'device_type': ranks[0]['device_type'],
      'peak_bytes': max(peaks) if peaks else None,
      'bytes_limit': ranks[0]['bytes_limit'],
      'step_seconds': max(r['step_seconds'] for r in ranks),
      'fsdp_file': ranks[0]['fsdp_file'],
  }


def print_table(results, layers_list):
  print(f"\n{'layers':>6}  {'variant':>21}  {'devices':>7}  {'peak MB':>9}  "
        f"{'step ms':>8}  {'peak vs F':>9}  {'step vs F':>9}")
  for layers in layers_list:
    unflat = results.get(f'patched flatten=False/{layers}', {})
    for build, flatten in VARIANTS:
      r = results[f'{label(build, flatten)}/{layers}']
      if 'error' in r:
        print(f'{layers:>6}  {label(build, flatten):>21}  failed: '
              f"{r['error'].strip().splitlines()[-1:]}")
        continue
      peak = r['peak_bytes']
      ratio = (f"{peak / unflat['peak_bytes']:.2f}x"
               if peak and unflat.get('peak_bytes') else '-')
      step_ratio = (f"{r['step_seconds'] / unflat['step_seconds']:.2f}x"
                    if unflat.get('step_seconds') else '-')
      peak_mb = f'{peak / MB:.1f}' if peak else '-'
      print(f"{layers:>6}  {label(build, flatten):>21}  {r['devices']:>7}  "
            f"{peak_mb:>9}  {r['step_seconds'] * 1e3:>8.1f}  {ratio:>9}  "
            f"{step_ratio:>9}")


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='\n'.join(__doc__.splitlines()[1:]))
  parser.add_argument(
      '--layers', type=int, nargs='+', default=[2, 4, 8], metavar='N')
  parser.add_argument('--steps', type=int, default=6)
  parser.add_argument('--out', default=os.path.join('out', 'report-devices'))
  parser.add_argument('--worker', metavar='DIR', help=argparse.SUPPRESS)
  parser.add_argument(
      '--flatten', type=int, choices=(0, 1), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.steps < 1 or min(args.layers) < 1:
    parser.error('--steps and --layers must be >= 1')

  if args.worker:
    import torch_xla
    torch_xla.launch(
        train_on_device,
        args=(args.layers[0], bool(args.flatten), args.steps, args.worker))
    return

  results = {}
  configs = [(layers, build, flatten)
             for layers in args.layers
             for build, flatten in VARIANTS]
  start = time.time()
  for i, (layers, build, flatten) in enumerate(configs, 1):
    print(
        f'[{i}/{len(configs)}] {layers} layers, {label(build, flatten)} ...',
        end=' ',
        flush=True)
    r = measure(build, flatten, layers, args.steps)
    results[f'{label(build, flatten)}/{layers}'] = r
    if 'error' in r:
      print('failed', flush=True)
    else:
      peak = f"{r['peak_bytes'] / MB:.1f} MB" if r['peak_bytes'] else '-'
      print(
          f"{r['devices']} {r['device_type']} device(s), peak {peak}, step "
          f"{r['step_seconds'] * 1e3:.1f} ms, {time.time() - start:.0f} s "
          'so far',
          flush=True)
  print_table(results, args.layers)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, 'report.json')
  with open(path, 'w') as f:
    json.dump({'steps': args.steps, 'results': results}, f, indent=2)
  print(f'\nwrote {path}')


if __name__ == '__main__':
  main()
