#!/usr/bin/env python3
"""The design space of the fixed flatten_parameters=True on the compilers.

Each variant changes one or more of the fixed FSDP's design choices (a
switch each, below) while tracing the step; the step is then compiled by the
TPU compiler (or XLA:GPU) as ``fsdp_compiler_memory.py`` does, and compared
with flatten_parameters=False (F) by the compiler's total, argument + output
+ temp - alias bytes, in units (the largest flat gradient the step
reduce-scatters).

A variant is a comma-separated list of SWITCH=CHOICE; the series' design is
the first choice of each switch (the variant ``series``):

  fwd     how forward makes the original parameters from the gathered flat
          parameter: ranges (1-D ranges copied behind the barrier, then
          reshaped), shaped (copies of their shapes, behind the barrier),
          nobarrier (copies of their shapes, no barrier)
  bwd     the same for backward's re-gathered flat parameter, or views
          (slices of it: no copies)
  grad    the flat gradient: cat (the parameters' gradients concatenated),
          zeros (written in place into a zero buffer, a barrier after
          each), inplace (written in place into the re-gathered flat
          parameter), padsum (the sum of the gradients, each zero-padded
          to its place: one elementwise op that the compiler can fuse,
          where it makes a concatenation a chain of in-place updates)
  gather  whole (with FSDP's default pin_layout_in_collective_ops=True,
          torch_xla's all-gather is an all-reduce of a zero-padded buffer
          of the result's size, here a whole flat parameter), pieces (the
          flat parameter's shard gathered in pieces no larger than its
          largest parameter, put back in rank order), halves (pieces of
          half that), spliced (pieces, the barrier after the gather on the
          pieces, so that the copies out of the flat parameter read them
          without a concatenated buffer), unpinned
          (pin_layout_in_collective_ops=False: an all-gather, whole) or
          out (xm.all_gather given an output tensor: an all-gather with a
          pinned layout, whole; for F too with --f-design gather=out)
  pad     what a shard's size is a multiple of: 128 (FSDP's
          _shard_size_multiple; a shard is gathered as a [rows, 128] view,
          which TPU tiles in [8, 128], so unless rows is a multiple of 8
          the gathered [world size, rows, 128] is copied to be made flat)
          or 1024 (whole tiles; for F too with --f-design pad=1024), or
          flat (each flat parameter made a multiple of world size x 1024
          elements when it is made, by a zero tail that no parameter
          reads: whole tiles, and a gradient of the gathered buffer's size,
          which needs no pad for its reduce-scatter; F unchanged)
  padgrad where the post-backward hook pads a flat gradient to the
          reduce-scatter's size: after (behind the barrier that ties it to
          the shard, as FSDP does: a copy of the whole gradient) or before
          (the padded gradient goes through that barrier, so that a
          compiler may fuse the pad into the op that makes the gradient;
          the TPU compiler does not)
  barriers both (the default), fwd, bwd or none: FSDP's
          optimization_barrier_in_forward / _in_backward
  divide  where a flat gradient is divided by gradient_predivide_factor:
          hook (the post-backward hook, the whole flat gradient) or
          backward (each parameter's gradient as it is put into the flat
          one; also under no_sync(), which gives the same sums where the
          factor is a power of 2)
  scatter whole (a flat gradient reduce-scattered at once) or pieces (in
          pieces of its [world size, shard] view no larger than its largest
          parameter, put back in order; torch_xla adds its ordering token to
          a collective's input, a second buffer of the input's size when
          reduced at once)

  python benchmarks/fsdp_design_sweep.py --variants series bwd=views \\
      --models report --layers 2 4 --targets tpu-v4 tpu-v5p
  python benchmarks/fsdp_design_sweep.py --models llama --targets tpu-v5e
  python benchmarks/fsdp_design_sweep.py --variants scatter=pieces \\
      --models t5-four --live
  LIBTPU_INIT_ARGS=--xla_memory_scheduler=list \\
      python benchmarks/fsdp_design_sweep.py --variants series --layers 2

(LIBTPU_INIT_ARGS, the TPU compiler's settings, and DISABLE_NUMERIC_CC_TOKEN,
torch_xla's switch that leaves its ordering token out of collectives, apply
to F's compiles too; the table names them.)

Prints a table (units above F per variant, target and model; with --live
also what is resident at each compiler's peak, its large buffers, and how
much of the compiler's temp its buffer assignment's heap is) and
writes the results as JSON with --json. Traces are cached; each trace and
each compile runs in a process of its own, one at a time (see
``fsdp_compiler_memory.py``).
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import fsdp_compiler_memory as cm  # noqa: E402

SWITCHES = {
    'fwd': ('ranges', 'shaped', 'nobarrier'),
    'bwd': ('ranges', 'shaped', 'nobarrier', 'views'),
    'grad': ('cat', 'zeros', 'inplace', 'padsum'),
    'gather': ('whole', 'pieces', 'unpinned', 'halves', 'spliced', 'out'),
    'barriers': ('both', 'fwd', 'bwd', 'none'),
    'divide': ('hook', 'backward'),
    'scatter': ('whole', 'pieces'),
    'pad': ('128', '1024', 'flat'),
    'padgrad': ('after', 'before'),
}
SERIES = 'series'
DEFAULT_VARIANTS = (SERIES, 'gather=pieces', 'gather=unpinned', 'gather=out',
                    'scatter=pieces', 'fwd=shaped', 'fwd=nobarrier',
                    'bwd=shaped', 'bwd=views', 'bwd=nobarrier', 'grad=zeros',
                    'grad=inplace', 'grad=padsum', 'barriers=fwd',
                    'barriers=bwd')


def parse(variant: str) -> Dict[str, str]:
  """The choice of every switch in ``variant``."""
  choices = {k: v[0] for k, v in SWITCHES.items()}
  if variant == SERIES:
    return choices
  for item in variant.split(','):
    key, _, value = item.partition('=')
    if key not in SWITCHES or value not in SWITCHES[key]:
      raise ValueError(f'{item!r} in variant {variant!r}: expected one of ' +
                       ', '.join(
                           f"{k}={'|'.join(v)}" for k, v in SWITCHES.items()))
    choices[key] = value
  return choices


_applied = False


def apply(variant: str) -> None:
  """Change this process's (the checkout's) FSDP to ``variant`` (in a
  tracing process, before the model is wrapped). ``gather=unpinned`` is
  applied by the caller (``pin_layout_in_collective_ops``). Once per
  process: on CPU ``torch_xla.launch`` runs each device's worker in a thread
  of one process."""
  global _applied
  if _applied:
    return
  _applied = True
  import torch
  from torch_xla.distributed.fsdp import xla_fully_sharded_data_parallel as m
  from torch_xla.distributed.fsdp.xla_flatten_params_wrapper import (
      _split_tensor)
  s = parse(variant)
  phase = ['fwd']
  series_copy_out = m._copy_out

  def copy_out(flat_param, barrier):
    mode = s[phase[0]]
    if mode == 'ranges':
      return series_copy_out(flat_param, barrier)
    pieces = _split_tensor(flat_param.detach(), flat_param._param_numels)
    shapes = flat_param._param_shapes
    if mode == 'views':
      return [t.view(shape) for t, shape in zip(pieces, shapes)]
    out = [t.view(shape).clone() for t, shape in zip(pieces, shapes)]
    if mode == 'shaped' and barrier is not None:
      barrier(out)
    return out

  m._copy_out = copy_out
  point = m._UnflattenedParams.point_at_flat_param

  def point_at_flat_param(self):
    phase[0] = 'bwd'
    try:
      point(self)
    finally:
      phase[0] = 'fwd'

  m._UnflattenedParams.point_at_flat_param = point_at_flat_param

  unflatten = m._UnflattenFlatParameter
  if s['divide'] == 'backward':
    unflattened_init = m._UnflattenedParams.__init__

    def params_init(self, flat_param, unit):
      unflattened_init(self, flat_param, unit)
      flat_param._predivide = unit.gradient_predivide_factor

    m._UnflattenedParams.__init__ = params_init
    hook = m.XlaFullyShardedDataParallel._post_backward_hook

    def _post_backward_hook(self, param, *unused):
      if not isinstance(param, m.FlatParameter):
        return hook(self, param, *unused)
      factor, self.gradient_predivide_factor = (self.gradient_predivide_factor,
                                                1.0)
      try:
        return hook(self, param, *unused)
      finally:
        self.gradient_predivide_factor = factor

    m.XlaFullyShardedDataParallel._post_backward_hook = _post_backward_hook

  def divided(ctx, g):
    factor = getattr(ctx.flat_param, '_predivide', 1.0)
    return g / factor if factor > 1 else g

  if s['grad'] != 'cat' or s['divide'] != 'hook':
    forward = unflatten.forward

    def fwd(ctx, flat_param, barrier):
      ctx.flat_param, ctx.barrier = flat_param, barrier
      return forward(ctx, flat_param, barrier)

    def bwd(ctx, *grads):
      some_grad = next((g for g in grads if g is not None), None)
      if some_grad is None:
        return None, None
      total = sum(ctx.numels)
      if s['grad'] == 'padsum':
        flat, offset = None, 0
        for g, numel in zip(grads, ctx.numels):
          if g is not None:
            g = torch.nn.functional.pad(
                divided(ctx, g.reshape(-1)), (offset, total - offset - numel))
            flat = g if flat is None else flat + g
          offset += numel
        return flat, None
      if s['grad'] == 'cat':
        return torch.cat([
            divided(ctx, g.reshape(-1))
            if g is not None else some_grad.new_zeros(numel)
            for g, numel in zip(grads, ctx.numels)
        ]), None
      flat = (
          ctx.flat_param.detach()
          if s['grad'] == 'inplace' else some_grad.new_zeros(total))
      offset = total
      for g, numel in reversed(list(zip(grads, ctx.numels))):
        offset -= numel
        g = (
            divided(ctx, g.reshape(-1))
            if g is not None else some_grad.new_zeros(numel))
        flat = torch.as_strided_scatter(flat, g, (numel,), (1,), offset)
        if ctx.barrier is not None:
          ctx.barrier([flat])
      return flat, None

    unflatten.forward = staticmethod(fwd)
    unflatten.backward = staticmethod(bwd)

  if s['pad'] == 'flat':
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import xla_flatten_params_wrapper as fpw
    init_flatten_params = fpw.XlaFlattenParamsWrapper._init_flatten_params

    def _init_flatten_params(self, p_set):
      # (a zero parameter of a module of its own, last: no parameter reads
      # it, so its gradient is None)
      params, infos, shared = init_flatten_params(self, p_set)
      tail = -sum(p.numel() for p in params) % (xr.world_size() * 1024)
      if tail:
        holder = torch.nn.Module()
        holder.tail = torch.nn.Parameter(
            params[0].detach().new_zeros(tail),
            requires_grad=params[0].requires_grad)
        params.append(holder.tail)
        infos.append(('', holder, 'tail'))
      return params, infos, shared

    fpw.XlaFlattenParamsWrapper._init_flatten_params = _init_flatten_params

  if s['pad'] == '1024':
    pad = m.XlaFullyShardedDataParallel._flatten_and_pad_to_world_size

    def _flatten_and_pad_to_world_size(self, tensor, world_size):
      # (shards, and gradients for the reduce-scatter, padded to whole
      # [8, 128] tiles; gathered as [rows, 128] views still)
      if (self._shard_size_multiple == 128 and
          world_size == self.world_size * 128):
        world_size = self.world_size * 1024
      return pad(self, tensor, world_size)

    m.XlaFullyShardedDataParallel._flatten_and_pad_to_world_size = (
        _flatten_and_pad_to_world_size)

  if s['padgrad'] == 'before':
    barrier_with = (
        m.XlaFullyShardedDataParallel._apply_opt_barrier_to_params_and_tensors)
    pad_to = m.XlaFullyShardedDataParallel._flatten_and_pad_to_world_size

    def _apply_opt_barrier_to_params_and_tensors(self, p_list, p_shard_list,
                                                 dependency_tensors):
      # (the post-backward hook's barrier on a flat gradient: on its padded
      # copy instead, which _flatten_and_pad_to_world_size then returns)
      shard = p_shard_list[0] if len(p_shard_list) == 1 else None
      if (not p_list and len(dependency_tensors) == 1 and
          self.training_state == m.TrainingState.BACKWARD_POST and any(
              p._sharded_param is shard
              for p in self.full_params
              if isinstance(p, m.FlatParameter))):
        grad = dependency_tensors[0]
        padded = pad_to(self, grad, self.world_size * self._shard_size_multiple)
        if padded.numel() != grad.numel():
          # (not the gradient itself: a tensor that refers to itself outlives
          # the step, and torch_xla makes it an output of the step)
          grad._padded_early = padded
          dependency_tensors = [padded]
      return barrier_with(self, p_list, p_shard_list, dependency_tensors)

    def _flatten_and_pad_to_world_size(self, tensor, world_size):
      padded = getattr(tensor, '_padded_early', None)
      return pad_to(self, tensor, world_size) if padded is None else padded

    m.XlaFullyShardedDataParallel._apply_opt_barrier_to_params_and_tensors = (
        _apply_opt_barrier_to_params_and_tensors)
    m.XlaFullyShardedDataParallel._flatten_and_pad_to_world_size = (
        _flatten_and_pad_to_world_size)

  if s['barriers'] != 'both':
    init = m.XlaFullyShardedDataParallel.__init__

    def __init__(self, *args, **kwargs):
      kwargs['optimization_barrier_in_forward'] = s['barriers'] == 'fwd'
      kwargs['optimization_barrier_in_backward'] = s['barriers'] == 'bwd'
      init(self, *args, **kwargs)

    m.XlaFullyShardedDataParallel.__init__ = __init__

  def after_init(setup):
    # (``setup(unit)`` after each FSDP unit's __init__)
    init = m.XlaFullyShardedDataParallel.__init__

    def __init__(self, *args, **kwargs):
      init(self, *args, **kwargs)
      setup(self)

    m.XlaFullyShardedDataParallel.__init__ = __init__

  def flat_param_and_pieces(unit, per_parameter=1):
    # (a unit's flat parameter, or None, and how many pieces of it are no
    # larger than its largest parameter / per_parameter)
    flat = [p for p in unit.full_params if isinstance(p, m.FlatParameter)]
    if not flat:
      return None, 1
    numels = flat[0]._param_numels
    return flat[0], math.ceil(per_parameter * sum(numels) / max(numels))

  if s['gather'] in ('pieces', 'halves', 'spliced'):

    def gather_in_pieces(unit):
      flat, pieces = flat_param_and_pieces(unit,
                                           2 if s['gather'] == 'halves' else 1)
      if flat is None:
        return
      shard_numel = flat._sharded_param.numel()
      gather = unit.all_gather_op

      def all_gather_op(t, groups=None):
        # (the flat parameter's shard, or its 2-D view: gathered in pieces,
        # put back in rank order)
        if (not isinstance(t, torch.Tensor) or t.numel() != shard_numel or
            pieces == 1):
          return gather(t, groups=groups)
        chunks = t.chunk(pieces)
        gathered = [gather(c, groups=groups) for c in chunks]
        if s['gather'] == 'spliced':
          # the gather's barrier on the pieces, not their concatenation
          barrier(gathered)
          skip_next[0] = True
        return torch.cat([
            g.view(len(g) // len(c), *c.shape)
            for g, c in zip(gathered, chunks)
        ],
                         dim=1).flatten(0, 1)

      unit.all_gather_op = all_gather_op
      if s['gather'] == 'spliced':
        skip_next = [False]
        barrier = unit.optimization_barrier_op

        def optimization_barrier_op(tensors):
          # (the barrier after the gather: already on the pieces)
          if skip_next[0] and len(tensors) == 1:
            skip_next[0] = False
            return
          barrier(tensors)

        unit.optimization_barrier_op = optimization_barrier_op

    after_init(gather_in_pieces)

  if s['scatter'] == 'pieces':

    def scatter_in_pieces(unit):
      flat, pieces = flat_param_and_pieces(unit)
      if flat is None:
        return
      world = unit.world_size
      flat_numel = flat._sharded_param.numel() * world
      scatter = unit.reduce_scatter_op

      class InPieces:

        def __getattr__(self, name):
          return getattr(scatter, name)

        def __setattr__(self, name, value):
          setattr(scatter, name, value)

        def __call__(self, t, callback):
          if t.numel() != flat_numel or pieces == 1:
            return scatter(t, callback)
          chunks = t.view(world, -1).chunk(pieces, dim=1)
          done = []

          def collect(reduced):
            done.append(reduced)
            if len(done) == len(chunks):
              callback(torch.cat(done))

          for c in chunks:
            scatter(c.reshape(-1), collect)

      unit.reduce_scatter_op = InPieces()

    after_init(scatter_in_pieces)

  if s['gather'] == 'out':
    import torch_xla.core.xla_model as xm

    def gather_into_output(unit):
      gather = unit.all_gather_op

      def all_gather_op(t, groups=None):
        # (with an output, xm.all_gather is an all-gather, with the layout
        # pinned: no zero-padded all-reduce)
        if (not isinstance(t, torch.Tensor) or
            not gather.keywords['pin_layout']):
          return gather(t, groups=groups)
        out = t.new_empty((t.shape[0] * unit.world_size,) + tuple(t.shape[1:]))
        return xm.all_gather(t, groups=groups, output=out, pin_layout=True)

      unit.all_gather_op = all_gather_op

    after_init(gather_into_output)


def measure(variants: List[str],
            models: List[str],
            layers: List[int],
            targets: List[str],
            transformer_layers: Optional[int] = None,
            f_design: str = '',
            live: bool = False) -> List[dict]:
  """F once per model and depth (with the choices of ``f_design`` that
  apply to it), and fixed T per variant, compiled for each target: one dict
  per compile. ``live``: also what is resident at the compiler's peak
  (``live_bytes``), its buffers of half a unit or more (``large_buffers``)
  and the buffer assignment's heap (``heap_bytes``; ``cm.explain``)."""
  results = []
  configs = [
      (m, n)
      for m in models
      for n in (layers if m in cm.REPORT_MODELS else [transformer_layers])
  ]
  todo = len(configs) * (len(variants) + 1)
  done = 0
  for model, n in configs:
    for variant in [None] + list(variants):
      done += 1
      choices = parse(variant or f_design or SERIES)
      pinned = choices['gather'] != 'unpinned'
      design = f_design if variant is None else (
          '' if variant == SERIES else variant)
      cm.progress(f'[{done}/{todo}] {model} {n or ""} '
                  f"{'F' if variant is None else variant}")
      hlo = cm.trace(
          False,
          variant is not None,
          n,
          model=model,
          pin_layout=pinned,
          design=design)
      # (a unit: the largest of these over a model's variants, that is the
      # largest flat gradient a fixed step reduce-scatters)
      with open(hlo) as f:
        unit = cm.largest_gather_bytes(f.read())
      for target in targets:
        dumps = (
            tempfile.mkdtemp(prefix='fsdp_design_sweep_') if live else None)
        stats = cm.compile_hlo(hlo, target, dump_to=dumps)
        if dumps:
          peak = cm.explain(dumps, cm.names_path(hlo))
          shutil.rmtree(dumps, ignore_errors=True)
          stats['live_bytes'] = peak['peak_bytes']
          stats['heap_bytes'] = peak['heap_bytes']
          stats['large_buffers'] = [
              dict(
                  bytes=b['bytes'],
                  buffer=b['buffer'],
                  shape=b['shape'],
                  may_be=b['may_be'][:2])
              for b in peak['buffers']
              # (F's: its figures only; its unit is not the model's)
              if b['bytes'] >= unit / 2 and variant is not None
          ]
        results.append(
            dict(
                stats,
                model=model,
                layers=n or cm.LARGE.layers,
                variant=variant or 'F',
                target=target,
                unit_bytes=unit))
  return results


def units_table(results: List[dict], targets: List[str]) -> List[List[str]]:
  """Rows of variant, model, layers and, per target, fixed T's units above
  F (and its MB)."""
  find = {
      (r['model'], r['layers'], r['target'], r['variant']): r for r in results
  }
  configs = list(dict.fromkeys((r['model'], r['layers']) for r in results))
  variants = list(
      dict.fromkeys(r['variant'] for r in results if r['variant'] != 'F'))
  rows = []
  for model, n in configs:
    unit = max(r['unit_bytes']
               for r in results
               if (r['model'], r['layers']) == (model, n))
    rows.append([model, str(n), 'F'] + [
        f"{find[(model, n, t, 'F')]['total_bytes'] / cm.MB:.1f}"
        for t in targets
    ])
    for v in variants:
      row = [model, str(n), f'{v} *' if v == SERIES else v]
      for t in targets:
        f, x = (find.get((model, n, t, k)) for k in ('F', v))
        row.append('-' if x is None else
                   f"{(x['total_bytes'] - f['total_bytes']) / unit:+.2f} "
                   f"({x['total_bytes'] / cm.MB:.1f})")
      rows.append(row)
  return rows


def print_table(results: List[dict], targets: List[str]) -> None:
  rows = units_table(results, targets)
  header = ['model', 'layers', 'variant'] + targets
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
  print('\nFixed T per variant: units above F (MB); the F rows: F in MB. '
        'MB = argument + output + temp - alias; a unit = the largest flat '
        'gradient reduce-scattered; * the default (this checkout).')
  # (settings that change every figure, F's too)
  for var in ('LIBTPU_INIT_ARGS', 'DISABLE_NUMERIC_CC_TOKEN'):
    if os.environ.get(var):
      print(f'{var}={os.environ[var]}')
  for r in [header] + rows:
    print('  '.join(f'{c:>{w}}' for c, w in zip(r, widths)))
  explained = [r for r in results if 'live_bytes' in r]
  if explained:
    print('\nAt each compiler\'s peak (--live): MB resident, and the buffers '
          'of half a unit or more')
  for r in explained:
    print(f"{r['model']} {r['layers']} {r['variant']} {r['target']}: "
          f"{r['live_bytes'] / cm.MB:.1f} of {r['total_bytes'] / cm.MB:.1f}; "
          f"temp {r['temp_bytes'] / cm.MB:.1f}, of which the buffer "
          f"assignment's heap {r['heap_bytes'] / cm.MB:.1f}")
    for b in r['large_buffers']:
      print(f"  {b['bytes'] / cm.MB:7.1f}  {b['shape']}  {b['buffer']}  "
            f"{'; '.join(b['may_be'])}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='\n'.join(__doc__.splitlines()[1:]))
  parser.add_argument('--variants', nargs='+', default=list(DEFAULT_VARIANTS))
  parser.add_argument(
      '--models', nargs='+', default=['report'], choices=cm.MODELS)
  parser.add_argument('--layers', type=int, nargs='+', default=[2, 4, 8])
  parser.add_argument(
      '--targets',
      nargs='+',
      choices=sorted(t for t, (p, _) in cm.TARGETS.items() if p == 'tpu'),
      default=['tpu-v5e', 'tpu-v4', 'tpu-v5p', 'tpu-v6e'])
  parser.add_argument(
      '--transformer-layers',
      type=int,
      help=f'depth of the transformers (default {cm.LARGE.layers})')
  parser.add_argument(
      '--f-design',
      default='',
      help='trace F with this variant (e.g. gather=out, which changes '
      "flatten_parameters=False's gathers too)")
  parser.add_argument(
      '--live',
      action='store_true',
      help="also what is resident at each compiler's peak, its buffers of "
      "half a unit or more, and the buffer assignment's heap")
  parser.add_argument('--json', help='write the results there')
  args = parser.parse_args(argv)
  for v in args.variants + ([args.f_design] if args.f_design else []):
    try:
      parse(v)
    except ValueError as e:
      parser.error(str(e))
  for t in args.targets:
    if cm.missing(t):
      parser.error(f'{t}: {cm.missing(t)}')
  results = measure(args.variants, args.models, args.layers, args.targets,
                    args.transformer_layers, args.f_design, args.live)
  print_table(results, args.targets)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
