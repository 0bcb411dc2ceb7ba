#!/usr/bin/env python3
"""Speed report: stock vs patched FSDP, flatten_parameters False vs True.

Trace time (zero_grad, forward, backward and optimizer step, up to
``torch_xla.sync()``; CPU time of the tracing thread, which other load on
the machine disturbs less than wall time) and execution time (wall time
from the sync until the loss is read) of a training step, medians over the timed steps, with the step
graph's instructions and collectives as traced (the HLO before XLA's
optimizations). Two columns explain where time goes on the host: *zero*, the
trace time of ``zero_grad()`` alone (dropping the gradients frees their
buffers), and *faults*, the memory a step touches for the first time (minor
page faults, in MB): the C allocator returns buffers above its mmap threshold
(32 MB in glibc) to the kernel when freed and gets fresh zeroed pages for the
next step. Models:

  small-<N>  4 FSDP units under a root, flatten on both levels; each unit is
             N/4 residual pairs x + tanh(Linear(LayerNorm(x))) of width 64,
             so N parameters per unit (many small parameters). SGD, batch 16.
  large-16   the same with 6 units of 4 pairs of width 512 (few large ones).
  report     the model of pytorch/xla#5464 (2 layers of 8 Linear(1280, 1280),
             one unit per layer), SGD, batch 64.

Each on XLA's default pipeline and with optimization barriers kept
(``--xla_disable_hlo_passes=cse_barrier_expander``, as on TPU). Every run
is a process of its own (stock: TORCH_XLA_FSDP_OVERLAY=0); the variants of
a configuration run in turn, ``--rounds`` times, and each figure is the
median over the rounds, so that ratios come from one run of this script.

  python benchmarks/fsdp_flatten_speed.py                  # CPU, ~15 minutes
  python benchmarks/fsdp_flatten_speed.py --models small-128 --rounds 1

Writes speed.json and trace_vs_params.png to --out (default out/report).
"""

import argparse
import glob
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = [('stock', False), ('stock', True), ('patched', False),
            ('patched', True)]
PIPELINES = ('default', 'barriers')
KEEP_BARRIERS = '--xla_disable_hlo_passes=cse_barrier_expander'
MODELS = {
    # name: (units, pairs per unit, width, batch)
    'small-32': (4, 8, 64, 16),
    'small-128': (4, 32, 64, 16),
    'small-512': (4, 128, 64, 16),
    'large-16': (6, 4, 512, 16),
    'report': None,
}
DEFAULT_MODELS = ['small-128', 'large-16', 'report', 'small-32', 'small-512']
# the linearity figure: patched and stock flatten=True, default pipeline
LINEAR_MODELS = ('small-32', 'small-128', 'small-512')
# measured only for that figure
LINEARITY_ONLY = ('small-32', 'small-512')


def label(build, flatten):
  return f"{build} flatten={'True' if flatten else 'False'}"


def child(spec):
  """Runs in the measuring process: prints one JSON line."""
  dump = tempfile.mkdtemp(prefix='fsdp_speed_')
  flags = [os.environ.get('XLA_FLAGS', ''), f'--xla_dump_to={dump}']
  if spec['pipeline'] == 'barriers':
    flags.append(KEEP_BARRIERS)
  os.environ['XLA_FLAGS'] = ' '.join(f for f in flags if f)
  import torch
  import torch.nn as nn
  import torch_xla
  import torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel as fsdp
  from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

  class Pair(nn.Module):

    def __init__(self, width):
      super().__init__()
      self.norm = nn.LayerNorm(width)
      self.fc = nn.Linear(width, width)

    def forward(self, x):
      return x + torch.tanh(self.fc(self.norm(x)))

  class Unit(nn.Module):

    def __init__(self, pairs, width):
      super().__init__()
      self.pairs = nn.ModuleList(Pair(width) for _ in range(pairs))

    def forward(self, x):
      for pair in self.pairs:
        x = pair(x)
      return x

  class Net(nn.Module):

    def __init__(self, units, pairs, width, flatten):
      super().__init__()
      self.units = nn.ModuleList(
          FSDP(Unit(pairs, width), flatten_parameters=flatten)
          for _ in range(units))
      self.head = nn.Linear(width, 10)

    def forward(self, x):
      for unit in self.units:
        x = unit(x)
      return self.head(x)

  sys.path.insert(
      0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'test'))
  flags = os.environ['XLA_FLAGS']
  import fsdp_memory_utils as mu
  # its flags keep barriers on CPU; XLA reads them at its first compilation
  os.environ['XLA_FLAGS'] = flags

  torch.manual_seed(0)
  device = torch_xla.device()
  flatten = spec['flatten']
  if spec['model'] == 'report':
    model = mu.wrap_report_model(2, flatten_parameters=flatten)
    x = torch.randn(mu.BATCH, mu.HIDDEN, device=device)
    loss_fn = lambda out: out.sum()
  else:
    units, pairs, width, batch = MODELS[spec['model']]
    model = FSDP(Net(units, pairs, width, flatten), flatten_parameters=flatten)
    x = torch.randn(batch, width, device=device)
    loss_fn = lambda out: out.pow(2).mean()
  optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
  torch_xla.sync()
  trace, execute, zero, faults = [], [], [], []
  for i in range(spec['warmup'] + spec['steps']):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0 = time.thread_time()
    optimizer.zero_grad()
    cz = time.thread_time()
    loss = loss_fn(model(x))
    loss.backward()
    optimizer.step()
    c1 = time.thread_time()
    t1 = time.perf_counter()
    torch_xla.sync()
    loss.item()
    t2 = time.perf_counter()
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if i >= spec['warmup']:
      trace.append(c1 - c0)
      execute.append(t2 - t1)
      zero.append(cz - c0)
      faults.append(f1 - f0)
  # the step graph: the largest graph traced
  before = max(
      glob.glob(os.path.join(dump, '*before_optimizations.txt')),
      key=os.path.getsize)
  with open(before) as f:
    hlo = f.read()
  shutil.rmtree(dump, ignore_errors=True)
  collectives = mu.count_hlo_collectives(hlo)
  page_mb = resource.getpagesize() / 2**20
  print(
      json.dumps({
          'trace_ms': 1e3 * statistics.median(trace),
          'exec_ms': 1e3 * statistics.median(execute),
          'zero_grad_ms': 1e3 * statistics.median(zero),
          'faults_mb': page_mb * statistics.median(faults),
          'instructions': len(re.findall(r'^\s*(?:ROOT )?%\S+ = ', hlo, re.M)),
          'all_gathers': collectives['all-gather'],
          'reduce_scatters': collectives['reduce-scatter'],
          'all_reduces': collectives['all-reduce'],
          'fsdp_file': fsdp.__file__,
      }))


def run_child(spec):
  env = dict(os.environ)
  env['TORCH_XLA_FSDP_OVERLAY'] = '0' if spec['build'] == 'stock' else '1'
  env.setdefault('PJRT_DEVICE', 'CPU')
  out = subprocess.run(
      [sys.executable,
       os.path.abspath(__file__), '--child',
       json.dumps(spec)],
      env=env,
      capture_output=True,
      text=True)
  if out.returncode != 0:
    raise RuntimeError(f'{spec} failed:\n{out.stderr[-4000:]}')
  return json.loads(out.stdout.strip().splitlines()[-1])


def configurations(args):
  configs = []
  for model in args.models:
    for pipeline in args.pipelines:
      if model not in LINEARITY_ONLY:
        configs.append((model, pipeline, VARIANTS))
      elif pipeline == 'default':
        configs.append((model, pipeline, [('stock', True), ('patched', True)]))
  return configs


def measure_all(args):
  configs = configurations(args)
  total = sum(len(v) for _, _, v in configs) * args.rounds
  done, start, results = 0, time.time(), []
  for model, pipeline, variants in configs:
    runs = {v: [] for v in variants}
    for _ in range(args.rounds):
      for build, flatten in variants:
        done += 1
        print(
            f'[{done}/{total}] {model}, {pipeline}, {label(build, flatten)} ...',
            end=' ',
            flush=True)
        r = run_child(
            dict(
                model=model,
                pipeline=pipeline,
                build=build,
                flatten=flatten,
                steps=args.steps,
                warmup=3))
        expected = 'site-packages' in r['fsdp_file']
        if expected != (build == 'stock'):
          raise RuntimeError(f"{label(build, flatten)} ran {r['fsdp_file']}")
        print(
            f"trace {r['trace_ms']:.0f} ms, exec {r['exec_ms']:.0f} ms, "
            f'{time.time() - start:.0f} s so far',
            flush=True)
        runs[(build, flatten)].append(r)
    for (build, flatten), rs in runs.items():
      row = dict(
          rs[-1], model=model, pipeline=pipeline, build=build, flatten=flatten)
      for key in ('trace_ms', 'exec_ms', 'zero_grad_ms', 'faults_mb'):
        row[key] = statistics.median(r[key] for r in rs)
        row[key + '_runs'] = [r[key] for r in rs]
      row.pop('fsdp_file')
      results.append(row)
  return results


def find(results, model, pipeline, build, flatten):
  for r in results:
    if (r['model'], r['pipeline'], r['build'],
        r['flatten']) == (model, pipeline, build, flatten):
      return r
  return None


def print_table(results):
  cols = [('model', 10), ('pipeline', 8), ('variant', 23), ('trace ms', 8),
          ('exec ms', 8), ('zero ms', 7), ('faults MB', 9), ('instrs', 6),
          ('ag', 3), ('rs', 3), ('ar', 3)]
  print()
  print('  '.join(f'{c:>{w}}' for c, w in cols))
  for r in results:
    row = [
        r['model'], r['pipeline'],
        label(r['build'],
              r['flatten']), f"{r['trace_ms']:.1f}", f"{r['exec_ms']:.1f}",
        f"{r['zero_grad_ms']:.1f}", f"{r['faults_mb']:.0f}", r['instructions'],
        r['all_gathers'], r['reduce_scatters'], r['all_reduces']
    ]
    print('  '.join(f'{v:>{w}}' for v, (_, w) in zip(row, cols)))
  print('\nPatched flatten=True against (trace / exec, same run):')
  print(f"{'model':>10}  {'pipeline':>8}  {'stock flatten=True':>18}  "
        f"{'flatten=False':>13}  same collectives as stock flatten=True")
  for model, pipeline in sorted({(r['model'], r['pipeline']) for r in results}):
    pf = find(results, model, pipeline, 'patched', True)
    sf = find(results, model, pipeline, 'stock', True)
    su = find(results, model, pipeline, 'stock', False)

    def ratio(other):
      return (f"{pf['trace_ms'] / other['trace_ms']:.2f}x / "
              f"{pf['exec_ms'] / other['exec_ms']:.2f}x")

    same = all(pf[k] == sf[k]
               for k in ('all_gathers', 'reduce_scatters', 'all_reduces'))
    print(f'{model:>10}  {pipeline:>8}  {ratio(sf):>18}  '
          f"{ratio(su) if su else '-':>13}  {'yes' if same else 'NO'}")


def plot(results, path):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for build in ('stock', 'patched'):
    rows = sorted(
        (r for r in results if r['model'] in LINEAR_MODELS and
         r['pipeline'] == 'default' and r['flatten'] and r['build'] == build),
        key=lambda r: MODELS[r['model']][1])
    params = [4 * MODELS[r['model']][1] for r in rows]
    for ax, key in zip(axes, ('trace_ms', 'instructions')):
      ax.plot(
          params, [r[key] for r in rows],
          marker='o',
          linestyle='-' if build == 'patched' else '--',
          label=label(build, True))
  for ax, what in zip(axes, ('trace time (ms)', 'traced HLO instructions')):
    ax.set_xlabel('parameters per FSDP unit (4 units)')
    ax.set_ylabel(what)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle('FSDP flatten_parameters=True: cost per step against '
               'parameters per unit')
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='\n'.join(__doc__.splitlines()[1:]))
  parser.add_argument(
      '--models',
      nargs='+',
      default=DEFAULT_MODELS,
      choices=sorted(MODELS),
      metavar='M')
  parser.add_argument(
      '--pipelines', nargs='+', default=list(PIPELINES), choices=PIPELINES)
  parser.add_argument('--steps', type=int, default=8)
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--out', default=os.path.join('out', 'report'))
  parser.add_argument('--child', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.steps < 1 or args.rounds < 1:
    parser.exit(2, 'error: --steps and --rounds must be >= 1\n')
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.child:
    child(json.loads(args.child))
    return
  os.makedirs(args.out, exist_ok=True)
  results = measure_all(args)
  print_table(results)
  written = [os.path.join(args.out, 'speed.json')]
  with open(written[0], 'w') as f:
    json.dump(results, f, indent=1)
  if sum(r['model'] in LINEAR_MODELS for r in results) > 2:
    written.append(os.path.join(args.out, 'trace_vs_params.png'))
    plot(results, written[-1])
  print('\nwrote ' + ', '.join(written))


if __name__ == '__main__':
  try:
    main()
  except RuntimeError as e:
    sys.exit(f'error: {str(e).splitlines()[0]}')
