#!/usr/bin/env python3
"""Memory report: stock vs patched FSDP, flatten_parameters False vs True.

On the TPU compiler and XLA:GPU (``pip install -e ".[compilers]"``), where
FSDP runs for users: each step traced at world size 8 with real collectives
and compiled without a chip for TPU v4, v5e, v5p and v6e and for A100 and
H100 (``fsdp_compiler_memory.py``; also world size 1 on XLA:GPU, the
configuration of pytorch/xla#5464): the model from pytorch/xla#5464 at each
depth and Hugging Face Llama, GPT-2, T5, BERT and Qwen2 at hidden 1024
(``fsdp_real_models.LARGE``). F, stock T and fixed T, and fixed T's excess
over F in units (the largest flat parameter the step gathers).

On XLA:CPU, the fast check: for each world size (1, and 8 simulated on one
device) and depth of the model from pytorch/xla#5464, for the transformers
built from small configs (``fsdp_real_models.SMALL``; ``pip install
".[models]"``), for units with activation checkpointing inside, or a model of
yours (``--models package.module:function``, see
``fsdp_memory_utils.model_step_stats``), measures the training step's
compiled graph:
peak bytes (XLA's own figure and the resident one, which counts a buffer
updated in place once), XLA's "Total bytes used" (every allocation of the
executable: what a device holds for the step), graph outputs, all-gathers, reduce-scatters,
instructions, compile and step time. Every configuration runs in a process
of its own, stock torch_xla with TORCH_XLA_FSDP_OVERLAY=0.

  python benchmarks/fsdp_flatten_memory.py          # quick: 4 CPU-minutes
  python benchmarks/fsdp_flatten_memory.py --all    # everything: about 2 hours
  python benchmarks/fsdp_flatten_memory.py --all --compilers none  # XLA:CPU only
  python benchmarks/fsdp_flatten_memory.py --compilers tpu-v5e gpu-h100
  python benchmarks/fsdp_flatten_memory.py --models gpt2 my_pkg.models:build
  python benchmarks/fsdp_flatten_memory.py --layers 2 4 --world-sizes 8
  python benchmarks/fsdp_flatten_memory.py --explain --layers 2 --world-sizes 8
  python benchmarks/fsdp_flatten_memory.py --pipeline default   # barriers dropped
  python benchmarks/fsdp_flatten_memory.py --with-speed  # and fsdp_flatten_speed.py

Without flags, the quick run: the model from pytorch/xla#5464 at 2 and 4
layers, world size 8, on XLA:CPU and (with the compilers extra) TPU v5e,
F / stock T / fixed T (under 4 minutes of CPU on 2 cores). --all runs everything
above (about 2 hours); the other flags change either.

On CPU the step graphs keep FSDP's optimization barriers, as on TPU (XLA's
CPU pipeline drops them); --pipeline default measures the plain CPU pipeline.

Writes report.json, compilers.json, peak_vs_layers.png (XLA:CPU) and
compilers_vs_layers.png (the TPU and GPU compilers) to --out (default
out/report). --replot compilers.json draws the latter again from a saved run.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

# CPU unless told otherwise; set before the helper decides its XLA flags.
os.environ.setdefault('PJRT_DEVICE', 'CPU')
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'test'))
import fsdp_memory_utils as mu  # noqa: E402
import fsdp_compiler_memory as cm  # noqa: E402

VARIANTS = [('stock', False), ('stock', True), ('patched', False),
            ('patched', True)]
# The quick run's: F once (the fix leaves flatten_parameters=False's step
# graph as stock's), stock T and fixed T.
QUICK_VARIANTS = [('stock', True), ('patched', False), ('patched', True)]
# functions of fsdp_real_models: SMALL on XLA:CPU, LARGE on the compilers
REAL_MODELS = cm.TRANSFORMERS
# Activation checkpointing inside each unit (fsdp_memory_utils), SGD, at each
# of --layers and the largest of --world-sizes: two blocks checkpointed one
# by one with checkpoint_module, or torch.utils.checkpoint inside a unit.
INNER_CHECKPOINT = {
    'ckpt-inside':
        'fsdp_memory_utils:inner_checkpoint_model',
    'torch-ckpt-reentrant':
        'fsdp_memory_utils:torch_reentrant_checkpoint_model',
    'torch-ckpt-non-reentrant':
        'fsdp_memory_utils:torch_non_reentrant_checkpoint_model',
}
MB = 1e6
# What the flags left unset take: the quick run (the default, a figure in
# minutes) or --all (the full report).
QUICK = dict(
    layers=[2, 4], world_sizes=[8], models=['report'], compilers=['tpu-v5e'])
ALL = dict(
    layers=[2, 4, 8],
    world_sizes=[1, 8],
    models=['report', *REAL_MODELS, *INNER_CHECKPOINT],
    compilers=list(cm.TARGETS))
# An explicit (empty) list of disabled passes stops the helper from adding
# its own, which keeps the barriers.
_PIPELINE_ENV = {
    'barriers': None,
    'default': {
        'XLA_FLAGS': '--xla_disable_hlo_passes='
    }
}


def label(build, flatten):
  return f"{build} flatten={'True' if flatten else 'False'}"


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='\n'.join(__doc__.splitlines()[1:]))
  parser.add_argument(
      '--all',
      action='store_true',
      help='the full report: every model, depth, world size and installed '
      'compiler (about 2 hours on 2 cores); without it, the quick run: '
      f"the report model at {QUICK['layers']} layers, world size "
      f"{QUICK['world_sizes'][0]}, XLA:CPU and {QUICK['compilers'][0]}")
  parser.add_argument(
      '--layers',
      type=int,
      nargs='+',
      metavar='N',
      help=f"default: {QUICK['layers']}, --all {ALL['layers']}")
  parser.add_argument(
      '--world-sizes',
      type=int,
      nargs='+',
      metavar='W',
      help=f"default: {QUICK['world_sizes']}, --all {ALL['world_sizes']}")
  parser.add_argument(
      '--models',
      nargs='+',
      metavar='MODEL',
      help="'report' (the report's model, at each of --layers), "
      f"{', '.join(REAL_MODELS)} (transformers), "
      f"{', '.join(INNER_CHECKPOINT)} (checkpointing inside each unit, at "
      'each of --layers and the largest world size), or '
      'package.module:function returning (module, example batch, classes to '
      "wrap as units); default: report; --all: all but your own")
  parser.add_argument('--steps', type=int, default=4)
  parser.add_argument('--out', default=os.path.join('out', 'report'))
  parser.add_argument(
      '--pipeline',
      choices=('barriers', 'default'),
      default='barriers',
      help='on CPU: keep optimization barriers (as on TPU, the default) or '
      "use XLA's default CPU pipeline, which drops them")
  parser.add_argument(
      '--with-speed',
      action='store_true',
      help='then run the speed report (fsdp_flatten_speed.py, with its '
      'defaults: the many-small- and few-large-parameter models too) into '
      '--out')
  parser.add_argument(
      '--compilers',
      nargs='+',
      choices=[*cm.TARGETS, 'none'],
      metavar='TARGET',
      help='also compile each step deviceless for these TPU and GPU targets '
      f"(of {', '.join(cm.TARGETS)}; 'none': XLA:CPU only), traced at world "
      f'size {cm.WORLD_SIZE} with real collectives: the report model at each '
      'of --layers (and on XLA:GPU at world size 1 too), the transformers '
      f'at hidden {cm.LARGE.hidden}. Default: {QUICK["compilers"][0]}; '
      "--all: every target; of those, the ones that the compilers extra "
      "installs (pip install -e '.[compilers]')")
  parser.add_argument(
      '--replot',
      metavar='COMPILERS_JSON',
      help='measure nothing: draw compilers_vs_layers.png again, beside '
      'COMPILERS_JSON (a compilers.json of this report, or a --json of '
      'fsdp_compiler_memory.py)')
  parser.add_argument(
      '--explain',
      action='store_true',
      help='for the first configuration only: what is resident at the peak '
      'of each variant, mapped to FSDP units and parameters; with compilers, '
      "also at each compiler's peak, for the report model's smallest depth")
  args = parser.parse_args(argv)
  if args.replot:
    return args
  preset = ALL if args.all else QUICK
  for key in ('layers', 'world_sizes', 'models'):
    if getattr(args, key) is None:
      setattr(args, key, list(preset[key]))
  if args.compilers and 'none' in args.compilers:
    if len(args.compilers) > 1:
      parser.exit(2, 'error: --compilers none names no other target\n')
    args.compilers = []
  elif args.compilers is None:
    args.compilers = [t for t in preset['compilers'] if cm.missing(t) is None]
    if not args.compilers:
      print(f"TPU and GPU compilers ({', '.join(preset['compilers'])}): not "
            "installed (pip install -e '.[compilers]'); XLA:CPU only")
  else:
    for t in args.compilers:
      if cm.missing(t):
        parser.exit(2, f'error: {t}: {cm.missing(t)}\n')
  for name, values, low in (('--layers', args.layers, 1), ('--world-sizes',
                                                           args.world_sizes, 1),
                            ('--steps', [args.steps], 3)):
    bad = [v for v in values if v < low]
    if bad:
      parser.exit(2, f'error: {name} must be >= {low}, got {bad[0]}\n')
  return args


def model_spec(model):
  """The ``--model`` of fsdp_memory_utils for a --models entry."""
  return f'fsdp_real_models:{model}' if model in REAL_MODELS else model


def configs_of(args):
  """(model, world size, layers) to measure; layers is None for a model of
  fixed depth."""
  configs = []
  for model in args.models:
    if model == 'report':
      configs += [(model, w, l) for w in args.world_sizes for l in args.layers]
    elif model in INNER_CHECKPOINT:
      configs += [(model, max(args.world_sizes), l) for l in args.layers]
    elif model in REAL_MODELS and importlib.util.find_spec(
        'transformers') is None:
      print(f'skipping {model}: needs transformers (pip install ".[models]")')
    elif model in REAL_MODELS or ':' in model:
      configs += [(model, w, None) for w in args.world_sizes]
    else:
      sys.exit(f'error: unknown model {model!r}: report, '
               f"{', '.join(REAL_MODELS)} or package.module:function")
  if args.explain:
    configs = [c for c in configs if c[0] == 'report'][:1]
  return configs


def measure_all(args):
  configs = configs_of(args)
  if args.explain:
    os.environ['XLA_HLO_DEBUG'] = '1'  # source lines in the children's HLO
  # the children import fsdp_real_models and the user's packages from here
  os.environ['PYTHONPATH'] = os.pathsep.join(
      p for p in (os.path.dirname(os.path.abspath(__file__)), os.getcwd(),
                  os.environ.get('PYTHONPATH')) if p)
  results = []
  variants = VARIANTS if args.all else QUICK_VARIANTS
  total = len(configs) * len(variants)
  start = time.time()
  for i, ((model, world_size, layers), (build, flatten)) in enumerate(
      ((c, v) for c in configs for v in variants), 1):
    what = (
        f'{model}, world size {world_size}'
        f'{" (simulated)" if world_size > 1 else ""}'
        f'{f", {layers} layers" if layers else ""}, {label(build, flatten)}')
    print(f'[{i}/{total}] {what} ...', end=' ', flush=True)
    if model in INNER_CHECKPOINT:
      kwargs = dict(
          model=INNER_CHECKPOINT[model], layers=layers, optimizer='sgd')
    else:
      kwargs = dict(layers=layers) if layers else dict(model=model_spec(model))
    stats = mu.measure_in_subprocess(
        stock=build == 'stock',
        world_size=world_size,
        flatten=flatten,
        steps=args.steps,
        explain=args.explain,
        env=_PIPELINE_ENV[args.pipeline],
        **kwargs)
    print(
        f"total {stats['total_allocated_bytes'] / MB:.1f} MB, "
        f"{time.time() - start:.0f} s so far",
        flush=True)
    results.append(
        dict(
            stats,
            model=model,
            build=build,
            flatten=flatten,
            world_size=world_size,
            layers=layers,
            pipeline=args.pipeline))
  return results


def measure_compilers(args):
  """The training step compiled for each of --compilers (dicts of
  ``fsdp_compiler_memory.measure``, with their world size)."""
  models = [m for m in args.models if m == 'report' or m in cm.TRANSFORMERS]
  if (set(models) & set(cm.TRANSFORMERS) and
      importlib.util.find_spec('transformers') is None):
    models = [m for m in models if m == 'report']
  if not (args.compilers and models):
    return []
  print(
      f"\nTPU and GPU compilers ({', '.join(args.compilers)}), deviceless; "
      'a line per trace and compile:',
      flush=True)
  layers = sorted(args.layers)
  results = []
  if args.explain and 'report' in models:
    # (dumps only for the configuration explained: XLA:GPU's are large)
    dump_to = os.path.join(args.out, 'compiler_dumps')
    for r in cm.measure(layers[:1], args.compilers, dump_to=dump_to):
      r['explained'] = cm.explain(r['dump_dir'], cm.names_path(r['hlo']))
      results.append(r)
    layers = layers[1:]
  if 'report' not in models:
    layers = []
  results += cm.measure(layers, args.compilers, models=models)
  for r in results:
    r['world_size'] = cm.WORLD_SIZE
  gpus = [t for t in args.compilers if cm.TARGETS[t][0] == 'cuda']
  if 'report' in models and gpus and 1 in args.world_sizes:
    # the configuration of pytorch/xla#5464
    results += [
        dict(r, world_size=1)
        for r in cm.measure(sorted(args.layers)[:1], gpus, world_size=1)
    ]
  return results


def print_compiler_tables(results, targets):
  if not results:
    return
  for world_size in sorted({r['world_size'] for r in results}, reverse=True):
    rows = [r for r in results if r['world_size'] == world_size]
    cm.print_table(rows,
                   [t for t in targets if any(r['target'] == t for r in rows)],
                   world_size)
  for r in results:
    if 'explained' not in r:
      continue
    e = r['explained']
    print(f"\n{r['variant']} on {r['target']}, report model, {r['layers']} "
          f"layers, world size {r['world_size']}: resident in device memory "
          f"at the compiler's peak {e['peak_bytes'] / MB:.1f} MB")
    print_buffers(e['buffers'])


def print_summary(results, compiled):
  """The report model's F / stock T / fixed T at each depth, on XLA:CPU and
  on each compiler, side by side: the figure this report is for."""
  cpu = [r for r in results if r['model'] == 'report']
  compiled = [r for r in compiled if r['model'] == 'report']
  depths = sorted({r['layers'] for r in cpu + compiled})
  if not depths:
    return
  rows = []
  for world_size in sorted({r['world_size'] for r in cpu}, reverse=True):
    cells = []
    for n in depths:
      three = [
          find(cpu, build, flatten, world_size, n)
          for build, flatten in (('patched', False), ('stock', True),
                                 ('patched', True))
      ]
      cells.append(' / '.join(
          f"{r['total_allocated_bytes'] / MB:.1f}" if r else '-'
          for r in three))
    rows.append(('XLA:CPU',
                 f"{world_size}{' (sim.)' if world_size > 1 else ''}", cells))
  targets = list(dict.fromkeys(r['target'] for r in compiled))
  for world_size in sorted({r['world_size'] for r in compiled}, reverse=True):
    for target in targets:
      by = {
          (r['layers'], r['variant']): r['total_bytes']
          for r in compiled
          if (r['target'], r['world_size']) == (target, world_size)
      }
      if not by:
        continue
      rows.append((target, str(world_size), [
          ' / '.join(f'{by[(n, v)] / MB:.1f}' if (n, v) in by else '-'
                     for v in cm.VARIANTS)
          for n in depths
      ]))
  print('\nThe model from pytorch/xla#5464 (layers of 8 Linear(1280, 1280), a '
        'unit each, SGD, batch 64),\nMB, F / stock T / fixed T (XLA:CPU: '
        '"Total bytes used"; compilers: argument + output + temp - alias):')
  cols = [('compiler', 9),
          ('world size', 10)] + [(f'{n} layers', 22) for n in depths]
  print('  '.join(f'{c:<{w}}' for c, w in cols))
  for where, world_size, cells in rows:
    print('  '.join(
        f'{v:<{w}}' for v, (_, w) in zip([where, world_size, *cells], cols)))


def find(results, build, flatten, world_size, layers, model='report'):
  for r in results:
    if (r['model'], r['build'], r['flatten'], r['world_size'],
        r['layers']) == (model, build, flatten, world_size, layers):
      return r
  return None


def print_models_table(results):
  """One row per model and world size: the four variants side by side."""
  # (in the order measured)
  rows = list(
      dict.fromkeys((r['model'], r['world_size'])
                    for r in results
                    if r['layers'] is None))
  if not rows:
    return
  print('\nModels (total MB = XLA\'s "Total bytes used"; F = flatten=False, '
        'T = flatten=True; times in ms):')
  cols = [('model', 22), ('ws', 3), ('F total', 8), ('stock T', 8),
          ('fixed T', 8), ('fixed/F', 7), ('outputs F/stock/fixed', 21),
          ('trace F/stock/fixed', 20), ('exec F/stock/fixed', 20)]
  print('  '.join(f'{c:>{w}}' for c, w in cols))
  for model, world_size in rows:
    f, st, fx = (find(results, build, flatten, world_size, None, model)
                 for build, flatten in (('patched', False), ('stock', True),
                                        ('patched', True)))
    three = lambda key, scale=1, fmt='.0f': '/'.join(f'{r[key] * scale:{fmt}}'
                                                     for r in (f, st, fx))
    row = [
        model[-22:], world_size, f"{f['total_allocated_bytes'] / MB:.1f}",
        f"{st['total_allocated_bytes'] / MB:.1f}",
        f"{fx['total_allocated_bytes'] / MB:.1f}",
        f"{fx['total_allocated_bytes'] / f['total_allocated_bytes']:.2f}x",
        '/'.join(str(len(r['output_shapes'])) for r in (f, st, fx)),
        three('trace_seconds', 1e3, '.1f'),
        three('step_seconds', 1e3)
    ]
    print('  '.join(f'{v:>{w}}' for v, (_, w) in zip(row, cols)))


def print_table(results):
  models = [r for r in results if r['layers'] is None]
  inner = [r for r in results if r['model'] in INNER_CHECKPOINT]
  results = [r for r in results if r['model'] == 'report']
  if results:
    print_report_table(results)
  print_models_table(models)
  print_inner_checkpoint_table(inner)


def print_inner_checkpoint_table(results):
  """Per style of checkpointing inside a unit: total MB at each depth, and
  what a layer adds, fixed T against F."""
  if not results:
    return
  print('\nCheckpointing inside each unit (total MB, F / stock T / fixed T; '
        'per layer: MB a layer adds, F / fixed T, and their ratio):')
  for model in dict.fromkeys(r['model'] for r in results):
    rows = [r for r in results if r['model'] == model]
    world_size = rows[0]['world_size']
    depths = sorted({r['layers'] for r in rows})
    total = {
        (r['build'], r['flatten'], r['layers']): r['total_allocated_bytes']
        for r in rows
    }
    cells = [
        f"{d} layers {total[('patched', False, d)] / MB:.1f} / "
        f"{total[('stock', True, d)] / MB:.1f} / "
        f"{total[('patched', True, d)] / MB:.1f}" for d in depths
    ]
    line = f'  {model} (world size {world_size}): ' + '; '.join(cells)
    if len(depths) > 1:
      slope = lambda flatten: (total[('patched', flatten, depths[-1])] - total[
          ('patched', flatten, depths[0])]) / (depths[-1] - depths[0]) / MB
      line += (f'; per layer {slope(False):.2f} / {slope(True):.2f} '
               f'({slope(True) / slope(False):.2f}x)')
    print(line)


def print_report_table(results):
  cols = [('variant', 24), ('ws', 3), ('L', 2), ('peak MB', 8), ('res MB', 8),
          ('total MB', 8), ('outputs', 7), ('ag', 4), ('rs', 4), ('instrs', 6),
          ('compile s', 9), ('step ms', 8)]
  print()
  print('  '.join(f'{c:>{w}}' for c, w in cols))
  for r in results:
    row = [
        label(r['build'], r['flatten']), r['world_size'], r['layers'],
        f"{r['peak_bytes'] / MB:.1f}", f"{r['peak_resident_bytes'] / MB:.1f}",
        f"{r['total_allocated_bytes'] / MB:.1f}",
        len(r['output_shapes']), r['num_all_gathers'], r['num_reduce_scatters'],
        r['num_instructions'], f"{r['compile_seconds']:.1f}",
        f"{r['step_seconds'] * 1e3:.0f}"
    ]
    print('  '.join(f'{v:>{w}}' for v, (_, w) in zip(row, cols)))
  print()
  print('Ratios (same run):')
  print(f"{'ws':>3}  {'L':>2}  {'patched flat/unflat peak':>24}  "
        f"{'resident':>8}  {'step':>5}  {'patched/stock flat peak':>23}  "
        f"{'step':>5}")
  seen = sorted({(r['world_size'], r['layers']) for r in results})
  for world_size, layers in seen:
    pf = find(results, 'patched', True, world_size, layers)
    pu = find(results, 'patched', False, world_size, layers)
    sf = find(results, 'stock', True, world_size, layers)
    print(f"{world_size:>3}  {layers:>2}  "
          f"{pf['peak_bytes'] / pu['peak_bytes']:>23.2f}x  "
          f"{pf['peak_resident_bytes'] / pu['peak_resident_bytes']:>7.2f}x  "
          f"{pf['step_seconds'] / pu['step_seconds']:>4.2f}x  "
          f"{pf['peak_bytes'] / sf['peak_bytes']:>22.2f}x  "
          f"{pf['step_seconds'] / sf['step_seconds']:>4.2f}x")
  if any(r['tpu_peak_bytes'] for r in results):
    print('\nTPU runtime peaks (xm.get_memory_info):')
    for r in results:
      print(f"  {label(r['build'], r['flatten']):24}  ws={r['world_size']} "
            f"L={r['layers']}  {r['tpu_peak_bytes'] / MB:.1f} MB")


def print_explanations(results):
  for r in results:
    print(f"\n{label(r['build'], r['flatten'])}, world size "
          f"{r['world_size']}, {r['layers']} layers: resident at the peak "
          f"{r['peak_resident_bytes'] / MB:.1f} MB")
    print_buffers(r['explained'])


def print_buffers(buffers):
  """Buffers of 1 MiB or more (``fsdp_memory_utils.explain_buffers``): size,
  shape, op (or the buffer's name), source line and what they may be."""
  for b in buffers:
    if b['bytes'] < 2**20:
      continue
    may_be = ', '.join(
        b['may_be'][:3]) + (' ...' if len(b['may_be']) > 3 else '')
    print(f"  {b['bytes'] / MB:7.1f} MB  {b['shape']:18} "
          f"{b['op'] or b['buffer']:28} {b['source']:40} {may_be}")
  small = sum(b['bytes'] for b in buffers if b['bytes'] < 2**20)
  print(f'  {small / MB:7.1f} MB  in buffers under 1 MiB')


def plot(results, path):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  world_sizes = sorted({r['world_size'] for r in results})
  fig, axes = plt.subplots(
      1, len(world_sizes), figsize=(6 * len(world_sizes), 4.5), squeeze=False)
  for ax, world_size in zip(axes[0], world_sizes):
    for build, flatten in VARIANTS:
      rows = sorted((r for r in results
                     if (r['build'], r['flatten'],
                         r['world_size']) == (build, flatten, world_size)),
                    key=lambda r: r['layers'])
      if not rows:  # (the quick run measures F once)
        continue
      ax.plot([r['layers'] for r in rows],
              [r['peak_resident_bytes'] / MB for r in rows],
              marker='o',
              linestyle='-' if build == 'patched' else '--',
              label=label(build, flatten))
    ax.set_title(f"world size {world_size}"
                 f"{' (simulated)' if world_size > 1 else ''}")
    ax.set_xlabel('layers (FSDP units)')
    ax.set_ylabel('step-graph peak, resident (MB)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle('FSDP flatten_parameters memory (pytorch/xla#5464)')
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def plot_compilers(compiled, path):
  """Compiled step memory of the report model against depth, F / stock T /
  fixed T, a panel per compiler (world size 8)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  # (fsdp_compiler_memory.py --json writes no world size: it is 8 there)
  rows = [
      r for r in compiled if r['model'] == 'report' and
      r.get('world_size', cm.WORLD_SIZE) == cm.WORLD_SIZE
  ]
  targets = list(dict.fromkeys(r['target'] for r in rows))
  fig, axes = plt.subplots(
      1, len(targets), figsize=(6 * len(targets), 4), squeeze=False)
  styles = {
      'stock T': ('stock flatten_parameters=True', 'tab:red', '--'),
      'fixed T': ('fixed flatten_parameters=True', 'tab:green', '-'),
      'F': ('flatten_parameters=False', 'tab:blue', '-'),
  }
  for ax, target in zip(axes[0], targets):
    for variant, (name, color, line) in styles.items():
      points = sorted((r['layers'], r['total_bytes'] / MB)
                      for r in rows
                      if (r['target'], r['variant']) == (target, variant))
      ax.plot(
          *zip(*points), marker='o', color=color, linestyle=line, label=name)
    ax.set_xticks(sorted({r['layers'] for r in rows}))
    ax.set_title(f'{target}, world size {cm.WORLD_SIZE}')
    ax.set_xlabel('layers (FSDP units)')
    ax.set_ylabel('compiled training step (MB)')
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle('FSDP memory against depth, model of pytorch/xla#5464')
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main(argv=None):
  args = parse_args(argv)
  if args.replot:
    with open(args.replot) as f:
      compiled = json.load(f)
    path = os.path.join(
        os.path.dirname(os.path.abspath(args.replot)),
        'compilers_vs_layers.png')
    plot_compilers(compiled, path)
    print(f'wrote {path}')
    return
  os.makedirs(args.out, exist_ok=True)
  start = time.time()
  results = measure_all(args)
  compiled = measure_compilers(args)
  for r in results:  # per-run details (and a deleted dump's path)
    for key in ('resident_at_peak', 'live_at_peak', 'hlo_path'):
      r.pop(key, None)
  print_table(results)
  if args.explain:
    print_explanations(results)
  print_compiler_tables(compiled, args.compilers)
  if not args.compilers:
    print('\n(TPU and GPU compilers: none; see --compilers)')
  with open(os.path.join(args.out, 'report.json'), 'w') as f:
    json.dump(results, f, indent=1)
  written = [os.path.join(args.out, 'report.json')]
  if compiled:
    with open(os.path.join(args.out, 'compilers.json'), 'w') as f:
      json.dump(compiled, f, indent=1)
    written.append(os.path.join(args.out, 'compilers.json'))
    if len({r['layers'] for r in compiled if r['model'] == 'report'}) > 1:
      plot_compilers(compiled, os.path.join(args.out,
                                            'compilers_vs_layers.png'))
      written.append(os.path.join(args.out, 'compilers_vs_layers.png'))
  if len({r['layers'] for r in results if r['model'] == 'report'}) > 1:
    plot([r for r in results if r['model'] == 'report'],
         os.path.join(args.out, 'peak_vs_layers.png'))
    written.append(os.path.join(args.out, 'peak_vs_layers.png'))
  print_summary(results, compiled)
  print(f'\n{time.time() - start:.0f} s; wrote ' + ', '.join(written))
  if args.with_speed:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fsdp_flatten_speed
    fsdp_flatten_speed.main(['--out', args.out])


if __name__ == '__main__':
  try:
    main()
  except RuntimeError as e:
    sys.exit(f'error: {str(e).splitlines()[0]}')
