"""Step-graph memory measurement for XlaFullyShardedDataParallel.

The figures come from XLA itself: with ``--xla_dump_to`` every compiled graph
leaves a buffer assignment (the compiler's own liveness analysis of the
scheduled graph) next to its HLO. That makes peak bytes deterministic and
independent of the machine, which is what the memory tests assert on and what
``benchmarks/fsdp_flatten_memory.py`` reports. On TPU the runtime peak from
``xm.get_memory_info()`` is added.

XLA reads ``XLA_FLAGS`` once per process, at its first compilation. Importing
this module therefore adds the flags it needs when they are missing; import it
before running any XLA computation. Every measurement reads only the dump
files that appeared while it ran.

On CPU (``PJRT_DEVICE=CPU``) it also disables XLA's ``cse_barrier_expander``
pass. The CPU compiler otherwise removes optimization barriers before
scheduling, so none of FSDP's barriers (which order all-gathers after a
module's inputs and keep the backward re-gather distinct from the forward
gather) would hold, and the figures would describe a schedule that the TPU
compiler never produces.

Run as a script, it measures one configuration and prints JSON; this is how
the tests and the report compare stock and patched FSDP, which needs one
process each since the overlay is chosen at import.
"""

import argparse
import ast
import atexit
import contextlib
import dataclasses
import functools
import glob
import importlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

_DUMP_FLAG = '--xla_dump_to='
_KEEP_BARRIERS_FLAG = '--xla_disable_hlo_passes=cse_barrier_expander'


def _ensure_xla_flags() -> Tuple[str, bool]:
  """The dump folder, and whether it is a temporary one of this module's."""
  flags = os.environ.get('XLA_FLAGS', '')
  m = re.search(re.escape(_DUMP_FLAG) + r'(\S+)', flags)
  if m:
    path, temporary = m.group(1), False
  else:
    temporary = True
    path = tempfile.mkdtemp(prefix='fsdp_xla_dump_')
    # every graph of the process is dumped: hundreds of MB for a test file
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    flags += ' ' + _DUMP_FLAG + path
  if (os.environ.get('PJRT_DEVICE', '').upper() == 'CPU' and
      '--xla_disable_hlo_passes' not in flags):
    flags += ' ' + _KEEP_BARRIERS_FLAG
  os.environ['XLA_FLAGS'] = flags.strip()
  return path, temporary


DUMP_DIR, _DUMP_DIR_IS_TEMPORARY = _ensure_xla_flags()

import torch
import torch.nn as nn
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
import torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel as fsdp_module
from torch_xla.distributed.fsdp import (XlaFullyShardedDataParallel as FSDP,
                                        checkpoint_module)

import torch.nn.functional as F
import torch_xla.distributed.fsdp.utils as fsdp_utils
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

import fsdp_simulation
import fsdp_test_utils
from fsdp_test_utils import count_collectives

# ---------------------------------------------------------------------------
# The model from pytorch/xla issue 5464, with a configurable number of layers.
# ---------------------------------------------------------------------------

HIDDEN = 1280
BATCH = 64


class Submodule(nn.Module):

  def __init__(self, hidden=HIDDEN):
    super().__init__()
    self.fc1 = nn.Linear(hidden, hidden, bias=False)
    self.fc2 = nn.Linear(hidden, hidden, bias=False)
    self.fc3 = nn.Linear(hidden, hidden, bias=False)
    self.fc4 = nn.Linear(hidden, hidden, bias=False)

  def forward(self, x):
    x = self.fc4(self.fc3(self.fc2(self.fc1(x))))
    return F.softmax(x, dim=1)


class Layer(nn.Module):

  def __init__(self, hidden=HIDDEN):
    super().__init__()
    self.sb1 = Submodule(hidden)
    self.sb2 = Submodule(hidden)

  def forward(self, x):
    return F.softmax(self.sb2(self.sb1(x)), dim=1)


class BiasedLayer(Layer):
  """A ``Layer`` with a ``[32, columns]`` embedding (the shape of T5's
  ``relative_attention_bias``, ``columns`` heads), looked up by position
  bucket and added, heads first as T5's ``compute_bias`` lays it out, to the
  Layer's output."""

  def __init__(self, hidden=HIDDEN, columns=4):
    super().__init__(hidden)
    if hidden % columns:
      raise ValueError(
          f'hidden {hidden} must be a multiple of columns {columns}')
    self.relative_bias = nn.Embedding(32, columns)

  def forward(self, x):
    columns = self.relative_bias.embedding_dim
    positions = torch.arange(x.shape[1] // columns, device=x.device)
    buckets = positions % self.relative_bias.num_embeddings
    bias = self.relative_bias(buckets).t().reshape(-1)
    return super().forward(x) + bias


class Net(nn.Module):
  """``Net`` from the report; ``num_layers=2`` is the report's model."""

  def __init__(self, num_layers=2, hidden=HIDDEN, layer_cls=Layer):
    super().__init__()
    if num_layers < 1:
      raise ValueError(f'num_layers must be >= 1, got {num_layers}')
    self.layers = nn.ModuleList([layer_cls(hidden) for _ in range(num_layers)])

  def forward(self, x):
    for layer in self.layers:
      x = layer(x)
    return F.softmax(x, dim=1)


def layer_numel(hidden=HIDDEN) -> int:
  """Parameters of one ``Layer`` (one FSDP unit under the report's policy;
  a ``BiasedLayer`` has 32 x columns more)."""
  return 8 * hidden * hidden


def wrap_report_model(num_layers=2,
                      hidden=HIDDEN,
                      seed=0,
                      layer_cls=Layer,
                      **fsdp_kwargs) -> FSDP:
  """The report's model, one FSDP unit per ``Layer`` (``layer_cls``) plus an
  empty root."""
  torch.manual_seed(seed)
  model = Net(num_layers, hidden, layer_cls)
  policy = functools.partial(
      transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
  return FSDP(model, auto_wrap_policy=policy, **fsdp_kwargs)


class GeluBlock(nn.Module):
  """A GPT-2 MLP block: LayerNorm, Linear with bias, the tanh approximation
  of GELU in torch ops (as transformers' ``gelu_new``), Linear, residual.
  XLA may recompute the pre-activation in backward from the first bias."""

  def __init__(self, hidden=512):
    super().__init__()
    self.ln = nn.LayerNorm(hidden)
    self.fc = nn.Linear(hidden, 4 * hidden)
    self.proj = nn.Linear(4 * hidden, hidden)

  def forward(self, x):
    y = self.fc(self.ln(x))
    y = 0.5 * y * (1.0 + torch.tanh(
        math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))
    return x + self.proj(y)


def gelu_model(num_layers=2, hidden=512, tokens=8):
  """A stack of ``GeluBlock``s, an example batch and the unit class: a
  ``--model`` function (see ``model_step_stats``)."""
  return (nn.Sequential(*[GeluBlock(hidden) for _ in range(num_layers)]),
          torch.randn(tokens, hidden), {GeluBlock})


class TorchCheckpointLayer(Layer):
  """A ``Layer`` whose forward checkpoints each of its two blocks with
  ``torch.utils.checkpoint``."""

  def __init__(self, hidden=HIDDEN, use_reentrant=True):
    super().__init__(hidden)
    self.use_reentrant = use_reentrant

  def forward(self, x):
    for block in (self.sb1, self.sb2):
      x = fsdp_test_utils.torch_checkpoint(
          block, x, use_reentrant=self.use_reentrant)
    return F.softmax(x, dim=1)


def inner_checkpoint_model(num_layers=2,
                           hidden=512,
                           tokens=8,
                           style='checkpoint_module'):
  """``Layer``s (units) whose two blocks are checkpointed one by one, after
  a Linear of the root (so that the first unit's input requires a
  gradient): with torch_xla's ``checkpoint_module`` ('checkpoint_module'),
  or inside the Layer's forward with ``torch.utils.checkpoint``
  ('reentrant', 'non_reentrant'). A ``--model`` function."""
  layers = []
  for _ in range(num_layers):
    if style == 'checkpoint_module':
      layer = Layer(hidden)
      layer.sb1, layer.sb2 = map(checkpoint_module, (layer.sb1, layer.sb2))
    else:
      layer = TorchCheckpointLayer(hidden, style == 'reentrant')
    layers.append(layer)
  return (nn.Sequential(nn.Linear(hidden, hidden),
                        *layers), torch.randn(tokens, hidden), {Layer})


def torch_reentrant_checkpoint_model(num_layers=2):
  return inner_checkpoint_model(num_layers, style='reentrant')


def torch_non_reentrant_checkpoint_model(num_layers=2):
  return inner_checkpoint_model(num_layers, style='non_reentrant')


# ---------------------------------------------------------------------------
# Simulated world sizes.
# ---------------------------------------------------------------------------


def faithful_dummy_all_gather(value, dim=0, groups=None):
  """``utils.dummy_all_gather`` made to schedule like a real all-gather.

  The stock dummy is a ``repeat`` of the shard, which no collective orders:
  since the CPU compiler also drops barriers by default, common-subexpression
  elimination merged the backward re-gather with the forward gather and kept
  every gathered parameter alive from forward to backward. A real all-gather
  is chained to the other collectives (torch_xla's numeric token) and is
  never merged. Here the shard first goes through a real all-reduce over this
  single device (an identity on its values), which gives the dummy the
  chaining; its input stays shard-sized, as a real all-gather's does, and
  FSDP's barrier after every gather materializes the full-size result.
  """
  chained = xm.all_reduce(xm.REDUCE_SUM, value, groups=None, pin_layout=False)
  return fsdp_utils.dummy_all_gather(chained, dim=dim, groups=groups)


def faithful_dummy_all_reduce(reduce_type, inputs, scale=1.0, groups=None):
  """``utils.dummy_all_reduce`` chained to the other collectives as a real one.

  Real collectives read the previous collective's output (torch_xla's
  numeric token); a dummy that skips it changes how long those outputs live.
  A real all-reduce over this single device has the real chaining and
  returns ``inputs * scale``, as the dummy does.
  """
  return xm.all_reduce(
      xm.REDUCE_SUM, inputs, scale=scale, groups=None, pin_layout=False)


class FaithfulDummyReduceScatter(fsdp_utils.DummyReduceScatter):
  """``utils.DummyReduceScatter`` returning a fresh shard, as a real one does.

  Handing the callback a view of the full gradient (as torch_xla 2.9's dummy
  does) keeps every full gradient alive until the end of the step and makes
  it a graph output.
  """

  def __call__(self, input, callback):
    super().__call__(input, lambda shard: callback(shard.clone()))


@contextlib.contextmanager
def simulated_world_size(world_size: int, rank: int = 0, faithful: bool = True):
  """``fsdp_simulation.simulated_world_size``, for memory figures.

  Several CPU devices deadlock in collectives with torch_xla 2.9, so world
  sizes > 1 are simulated. With ``faithful``, the dummy collectives are
  replaced by the faithful ones above, which XLA schedules as it does real
  collectives.
  """
  orig = (fsdp_module.dummy_all_gather, fsdp_module.dummy_all_reduce,
          fsdp_module.DummyReduceScatter)
  if faithful and world_size > 1:
    fsdp_module.dummy_all_gather = faithful_dummy_all_gather
    fsdp_module.dummy_all_reduce = faithful_dummy_all_reduce
    fsdp_module.DummyReduceScatter = FaithfulDummyReduceScatter
  try:
    with fsdp_simulation.simulated_world_size(world_size, rank) as kwargs:
      yield kwargs
  finally:
    (fsdp_module.dummy_all_gather, fsdp_module.dummy_all_reduce,
     fsdp_module.DummyReduceScatter) = orig


# ---------------------------------------------------------------------------
# Reading XLA's dumps.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class StepGraphStats:
  """What XLA compiled for one training step."""
  module: str
  peak_bytes: int
  total_allocated_bytes: int
  peak_resident_bytes: int
  resident_at_peak: List[Tuple[str, int]]
  live_at_peak: List[Tuple[str, int]]
  output_shapes: List[str]
  num_instructions: int
  # collectives in the HLO handed to the compiler (one replica's would be
  # removed by its optimizations): all-gather, reduce-scatter, all-reduce
  hlo_collectives: Dict[str, int] = dataclasses.field(default_factory=dict)
  num_all_gathers: int = 0
  num_reduce_scatters: int = 0
  compile_seconds: float = 0.0
  step_seconds: float = 0.0
  # tracing: the host time of forward, backward and optimizer step
  trace_seconds: float = 0.0
  tpu_peak_bytes: Optional[int] = None
  explained: Optional[List[dict]] = None
  hlo_path: str = ''


_PEAK_RE = re.compile(r'Stack trace breakdown for peak usage: ([\d ]+) bytes')
_LIVE_RE = re.compile(r'^\s+(\S+?)(?:\{[^}]*\})?: (\d+) bytes')


def _split_top_level(s: str) -> List[str]:
  parts, depth, cur = [], 0, []
  for ch in s:
    if ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    if ch == ',' and depth == 0:
      parts.append(''.join(cur).strip())
      cur = []
    else:
      cur.append(ch)
  if ''.join(cur).strip():
    parts.append(''.join(cur).strip())
  return parts


def parse_entry_output_shapes(hlo_text: str) -> List[str]:
  """Shapes returned by the ENTRY computation, layouts dropped."""
  m = re.search(r'^ENTRY .*?\) -> (.*) \{\s*$', hlo_text, re.M)
  if m is None:
    raise ValueError('no ENTRY computation in HLO text')
  sig = re.sub(r'/\*.*?\*/', '', m.group(1))
  sig = re.sub(r'\{[\d,]*\}', '', sig).strip()
  if sig.startswith('(') and sig.endswith(')'):
    return _split_top_level(sig[1:-1])
  return [sig]


_TOTAL_RE = re.compile(r'^Total bytes used: (\d+)', re.M)


def parse_total_allocated(text: str) -> int:
  """All of the graph's allocations: parameters, outputs, constants and the
  temporaries' heap, in which buffers updated in place share their space."""
  m = _TOTAL_RE.search(text)
  if m is None:
    raise ValueError('no "Total bytes used" line in buffer assignment')
  return int(m.group(1))


_ALLOC_RE = re.compile(r'^allocation (\d+): ')
_VALUE_RE = re.compile(r'^ value: <\d+ (\S+) @\S+> \(size=(\d+),offset=(\d+)\)')
# `name{}` for an array value, `name{i}` for element i of a tuple (named so
# in the value lines too)
_RANGE_RE = re.compile(r'^\s+(\S+?)(\{[^}]*\}):(\d+)-(\d+)$')


def parse_resident_peak(text: str) -> Tuple[int, List[Tuple[str, int]]]:
  """Peak of the memory actually resident, and what is resident then.

  At each point of the schedule, the buffers whose live ranges include it,
  each distinct memory region (allocation, offset) counted once: XLA gives
  two values live at the same point the same region only when one updates
  the other in place, so this counts such a buffer once, where XLA's
  "peak usage" line counts it twice. "Total bytes used" is larger: it adds
  up every allocation, and the graph's parameters and outputs have
  allocations of their own for the whole step, live or not at the peak
  (besides any space the heap of temporaries leaves unused).
  """
  where = {}
  alloc = None
  for line in text.splitlines():
    m = _ALLOC_RE.match(line)
    if m:
      alloc = int(m.group(1))
      continue
    m = _VALUE_RE.match(line)
    if m and alloc is not None:
      where.setdefault(m.group(1), (alloc, int(m.group(3)), int(m.group(2))))
  ranges = []
  if 'BufferLiveRange:' not in text:
    raise ValueError('no BufferLiveRange section in buffer assignment')
  for line in text.split('BufferLiveRange:', 1)[1].splitlines()[1:]:
    m = _RANGE_RE.match(line)
    if m is None:
      if line.strip():
        break
      continue
    name = m.group(1) + ('' if m.group(2) == '{}' else m.group(2))
    if name in where:
      ranges.append((int(m.group(3)), int(m.group(4)), name))
  best, best_live = 0, []
  for t in sorted({start for start, _, _ in ranges}):
    regions = {}
    for start, end, name in ranges:
      if start <= t <= end:
        a, offset, size = where[name]
        if size > regions.get((a, offset), ('', 0))[1]:
          regions[(a, offset)] = (name, size)
    total = sum(size for _, size in regions.values())
    if total > best:
      best, best_live = total, sorted(regions.values(), key=lambda v: -v[1])
  return best, best_live


def parse_buffer_assignment(text: str) -> Tuple[int, List[Tuple[str, int]]]:
  """Peak bytes and the buffers live at the peak (name, bytes).

  This is XLA's "Stack trace breakdown for peak usage": the sum of the
  buffers whose live ranges include the peak instruction. An operand updated
  in place and its result both include that instruction, so such a buffer
  counts twice there; ``parse_total_allocated`` does not.
  """
  m = _PEAK_RE.search(text)
  if m is None:
    raise ValueError('no peak usage line in buffer assignment')
  peak = int(m.group(1).replace(' ', ''))
  live = []
  lines = text.splitlines()
  start = next(
      i for i, l in enumerate(lines) if 'Live ranges at' in l and '(peak)' in l)
  for line in lines[start + 1:]:
    lm = _LIVE_RE.match(line)
    if lm is None:
      break
    live.append((lm.group(1), int(lm.group(2))))
  return peak, live


_COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce')


def count_hlo_collectives(hlo_text: str) -> Dict[str, int]:
  """The collectives of an HLO module (async ones counted once).

  At world size 1 torch_xla emits no all-reduce (and so no all-gather with
  a pinned layout, which is an all-reduce) unless ``XLA_ALWAYS_ALLREDUCE=1``.
  """
  return {
      op: len(re.findall(r' ' + op + r'(?:-start)?\(', hlo_text))
      for op in _COLLECTIVES
  }


def _count_instructions(prefix: str) -> int:
  with open(_after_optimizations_path(prefix)) as f:
    return len(re.findall(r'^\s+(?:ROOT )?%?\S+ = ', f.read(), re.M))


def read_module(prefix: str) -> StepGraphStats:
  """Stats of one dumped module, ``prefix`` being ``.../module_NNNN.Name``."""
  with open(prefix + '.before_optimizations.txt') as f:
    before = f.read()
  ba_path = _buffer_assignment_path(prefix)
  with open(ba_path) as f:
    ba_text = f.read()
  peak, live = parse_buffer_assignment(ba_text)
  resident, resident_live = parse_resident_peak(ba_text)
  return StepGraphStats(
      module=os.path.basename(prefix),
      peak_bytes=peak,
      total_allocated_bytes=parse_total_allocated(ba_text),
      peak_resident_bytes=resident,
      resident_at_peak=resident_live,
      hlo_path=_after_optimizations_path(prefix),
      live_at_peak=live,
      output_shapes=parse_entry_output_shapes(before),
      hlo_collectives=count_hlo_collectives(before),
      num_instructions=_count_instructions(prefix))


def _after_optimizations_path(prefix: str) -> str:
  paths = [
      p for p in glob.glob(prefix + '.*after_optimizations.txt')
      if 'buffer-assignment' not in p
  ]
  if not paths:
    raise FileNotFoundError(f'no after_optimizations HLO for {prefix}')
  return paths[0]


def _buffer_assignment_path(prefix: str) -> str:
  paths = glob.glob(prefix + '.*after_optimizations-buffer-assignment.txt')
  if not paths:
    raise FileNotFoundError(f'no buffer assignment for {prefix}')
  return paths[0]


def _module_prefixes() -> set:
  return {
      p[:-len('.before_optimizations.txt')]
      for p in glob.glob(os.path.join(DUMP_DIR, '*.before_optimizations.txt'))
  }


def buffer_names(model: nn.Module) -> Dict[str, List[str]]:
  """What a buffer of each shape may be, from an FSDP model's structure.

  Maps an HLO shape string (e.g. ``f32[1280,1280]``) to descriptions such as
  ``gathered flat param of layers.0`` or ``layers.0.sb1.fc1.weight``.
  """
  names: Dict[str, List[str]] = {}

  def add(numel_or_size, what):
    dims = ([numel_or_size]
            if isinstance(numel_or_size, int) else list(numel_or_size))
    names.setdefault(f"f32[{','.join(map(str, dims))}]", []).append(what)

  def qualified(*names):
    """``names`` joined by dots, without FSDP's wrapper modules."""
    return '.'.join(
        x for name in names for x in name.split('.')
        if x and x not in ('(root)', '_fsdp_wrapped_module', '_fpw_module'))

  for unit_name, unit in model.named_modules():
    if not isinstance(unit, FSDP):
      continue
    unit_name = qualified(unit_name) or '(root)'
    multiple = unit.world_size * unit._shard_size_multiple
    for full, shard in zip(unit.full_params, unit.sharded_params):
      padded = -(-shard._orig_size.numel() // multiple) * multiple
      kind = 'flat param' if hasattr(full, '_param_numels') else 'param'
      add(padded, f'gathered {kind} of {unit_name}')
      add(shard.numel(), f'{kind} shard (or its grad) of {unit_name}')
      for (module_name, _, n), size in zip(
          getattr(full, '_param_infos', []), getattr(full, '_param_shapes',
                                                     [])):
        add(size, qualified(unit_name, module_name, n))
      if kind == 'param':
        add(shard._orig_size, qualified(unit_name, shard._orig_name))
  return names


_SOURCE_RE = re.compile(r'source_file="([^"]+)" source_line=(\d+)')
_OP_TYPE_RE = re.compile(r'op_type="([^"]+)"')


@functools.lru_cache(maxsize=None)
def _functions_of(path: str) -> List[Tuple[int, int, str]]:
  try:
    with open(path) as f:
      tree = ast.parse(f.read())
  except (OSError, SyntaxError):
    return []
  return [(n.lineno, n.end_lineno, n.name)
          for n in ast.walk(tree)
          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _where(path: str, line: int) -> str:
  enclosing = [(start, name)
               for start, end, name in _functions_of(path)
               if start <= line <= end]
  fn = f' {max(enclosing)[1]}' if enclosing else ''
  return f'{os.path.basename(path)}:{line}{fn}'


def explain_buffers(live: List[Tuple[str, int]], hlo_text: str,
                    names: Dict[str, List[str]]) -> List[dict]:
  """Describe buffers (name, bytes) by shape, op and the Python source.

  The source is the innermost Python frame XLA recorded for the op that
  made the buffer; run with ``XLA_HLO_DEBUG=1`` to have it.
  """
  out = []
  for name, size in live:
    m = re.search(r'%' + re.escape(name) + r' = (\S+) ([^\n]*)', hlo_text)
    shape = re.sub(r'\{[^{}]*\}', '', m.group(1)) if m else '?'
    line = m.group(2) if m else ''
    op = _OP_TYPE_RE.search(line)
    src = _SOURCE_RE.search(line)
    out.append({
        'buffer': name,
        'bytes': size,
        'shape': shape,
        'op': op.group(1) if op else '',
        'source': _where(src.group(1), int(src.group(2))) if src else '',
        'may_be': names.get(shape, []),
    })
  return out


def measure_training_step(step_fn: Callable[[], None],
                          num_steps: int = 3,
                          model: Optional[nn.Module] = None) -> StepGraphStats:
  """Run ``step_fn`` + ``torch_xla.sync()`` ``num_steps`` times.

  ``step_fn`` runs forward, backward and the optimizer step without syncing.
  The step graph is the largest graph compiled while this ran (warm-up
  graphs, e.g. the first step's, are smaller or equal); ``step_seconds`` is
  the median wall time of the steps after the first two, ``compile_seconds``
  the wall time of the first step minus that median. Given the FSDP
  ``model``, the collectives of the last step are counted.
  """
  if num_steps < 1:
    raise ValueError(f'num_steps must be >= 1, got {num_steps}')
  xm.wait_device_ops()
  seen = _module_prefixes()
  times, traces = [], []
  counts = {'all_gather': 0, 'reduce_scatter': 0}
  for i in range(num_steps):
    counting = (
        count_collectives(model) if model is not None and i == num_steps - 1
        else contextlib.nullcontext(counts))
    t0 = time.perf_counter()
    c0 = time.thread_time()
    with counting as counts:
      step_fn()
    traces.append(time.thread_time() - c0)
    torch_xla.sync()
    xm.wait_device_ops()
    times.append(time.perf_counter() - t0)
  new = sorted(_module_prefixes() - seen)
  if not new:
    raise RuntimeError(
        f'no XLA dump appeared in {DUMP_DIR}: import fsdp_memory_utils before '
        'any XLA computation runs (XLA reads XLA_FLAGS once per process)')
  stats = read_module(max(new, key=_count_instructions))
  stats.num_all_gathers = counts['all_gather']
  stats.num_reduce_scatters = counts['reduce_scatter']
  steady = times[2:] or times[1:] or times
  stats.step_seconds = statistics.median(steady)
  stats.trace_seconds = statistics.median(traces[2:] or traces[1:] or traces)
  stats.compile_seconds = max(0.0, times[0] - stats.step_seconds)
  if xr.device_type() == 'TPU':
    stats.tpu_peak_bytes = xm.get_memory_info().get('peak_bytes_used')
  return stats


FEATURES = ('plain', 'checkpoint', 'no_sync', 'eval')


def report_model_step_stats(num_layers: int = 2,
                            world_size: int = 1,
                            num_steps: int = 3,
                            batch: int = BATCH,
                            explain: bool = False,
                            feature: str = 'plain',
                            **fsdp_kwargs) -> StepGraphStats:
  """Step-graph stats of the report's training loop (SGD, batch 64).

  ``feature``: 'plain'; 'checkpoint' (each Layer unit wraps
  ``checkpoint_module(Layer)``); 'no_sync' (two half batches, the first
  under ``model.no_sync()``); 'eval' (the step is an eval-mode forward
  under ``torch.no_grad()``, its output kept). With ``explain``,
  ``stats.explained`` describes the buffers resident at the peak (see
  ``explain_buffers``).
  """
  if feature not in FEATURES:
    raise ValueError(f'feature must be one of {FEATURES}, got {feature!r}')
  if feature == 'checkpoint':
    fsdp_kwargs['auto_wrapper_callable'] = (
        lambda m, *args, **kw: FSDP(checkpoint_module(m), *args, **kw))
  with simulated_world_size(world_size) as sim_kwargs:
    model = wrap_report_model(num_layers, **sim_kwargs, **fsdp_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    device = torch_xla.device()
    kept = []

    def step():
      x = torch.randn(batch, HIDDEN, device=device)
      if feature == 'eval':
        model.eval()
        with torch.no_grad():
          kept[:] = [model(x)]
        return
      optimizer.zero_grad()
      if feature == 'no_sync':
        with model.no_sync():
          model(x[:batch // 2]).sum().backward()
        x = x[batch // 2:]
      loss = model(x).sum()
      loss.backward()
      optimizer.step()

    stats = measure_training_step(step, num_steps, model)
    if explain:
      with open(stats.hlo_path) as f:
        stats.explained = explain_buffers(stats.resident_at_peak, f.read(),
                                          buffer_names(model))
    return stats


def load_model_fn(spec: str) -> Callable:
  """The function that ``package.module:function`` names."""
  module_name, sep, fn_name = spec.partition(':')
  if not (sep and module_name and fn_name):
    raise ValueError(f'a model is package.module:function, got {spec!r}')
  try:
    return getattr(importlib.import_module(module_name), fn_name)
  except (ImportError, AttributeError) as e:
    raise ValueError(f'cannot load model {spec!r}: {e}') from e


def _loss_of(output) -> torch.Tensor:
  """A model's output if it is a scalar, its ``loss`` (as transformers'
  outputs with labels), else the mean of its squares."""
  loss = getattr(output, 'loss', output)
  if isinstance(loss, (tuple, list)):
    loss = loss[0]
  return loss if loss.dim() == 0 else loss.float().pow(2).mean()


def model_step_stats(spec: str,
                     world_size: int = 1,
                     num_steps: int = 3,
                     num_layers: Optional[int] = None,
                     optimizer: str = 'adamw',
                     **fsdp_kwargs) -> StepGraphStats:
  """Step-graph stats of training the model that ``spec`` names.

  ``spec`` is ``package.module:function``; the function returns the module
  (float32, on the CPU), an example batch (a tensor, a tuple of positional
  tensors or a dict of keyword tensors) and the classes of the submodules
  to wrap as FSDP units (``transformer_auto_wrap_policy``, plus the root).
  ``num_layers`` is passed on to the function if given. The loss is
  ``_loss_of(output)``; ``optimizer`` 'adamw' or 'sgd'; seed 0.
  """
  build = load_model_fn(spec)
  with simulated_world_size(world_size) as sim_kwargs:
    torch.manual_seed(0)
    if num_layers is None:
      module, batch, classes = build()
    else:
      module, batch, classes = build(num_layers=num_layers)
    policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls=set(classes))
    model = FSDP(module, auto_wrap_policy=policy, **sim_kwargs, **fsdp_kwargs)
    optimizer_cls = torch.optim.SGD if optimizer == 'sgd' else torch.optim.AdamW
    opt = optimizer_cls(model.parameters(), lr=1e-3)
    device = torch_xla.device()
    if isinstance(batch, dict):
      kwargs, args = {k: v.to(device) for k, v in batch.items()}, ()
    else:
      kwargs = {}
      args = tuple(
          t.to(device)
          for t in (batch if isinstance(batch, (tuple, list)) else (batch,)))

    def step():
      opt.zero_grad()
      _loss_of(model(*args, **kwargs)).backward()
      opt.step()

    return measure_training_step(step, num_steps, model)


def measure_in_subprocess(stock: Optional[bool] = None,
                          env: Optional[Dict[str, str]] = None,
                          **kwargs) -> dict:
  """Measure one report-model configuration in a fresh process.

  ``kwargs`` are this script's flags (``layers``, ``world_size``,
  ``flatten``, ``steps``, ``feature``, ``model``). ``stock=True`` turns the overlay off (stock
  torch_xla FSDP), ``False`` on; ``None`` keeps this process's setting.
  Returns the JSON this script prints, ``StepGraphStats`` fields plus
  ``fsdp_file``. ``env``: more environment variables for the child.
  """
  args = [sys.executable, os.path.abspath(__file__)]
  for k, v in kwargs.items():
    args += [
        f"--{k.replace('_', '-')}", v if isinstance(v, str) else str(int(v))
    ]
  env = dict(os.environ, **(env or {}))
  if stock is not None:
    env['TORCH_XLA_FSDP_OVERLAY'] = '0' if stock else '1'
  # The child picks its own dump folder (and the flags for its device).
  env['XLA_FLAGS'] = re.sub(
      re.escape(_DUMP_FLAG) + r'\S+|' + re.escape(_KEEP_BARRIERS_FLAG), '',
      env.get('XLA_FLAGS', '')).strip()
  out = subprocess.run(args, env=env, capture_output=True, text=True)
  if out.returncode != 0:
    raise RuntimeError(f'{" ".join(args)} failed:\n{out.stderr[-4000:]}')
  return json.loads(out.stdout.strip().splitlines()[-1])


def cleanup_dumps() -> None:
  """Remove the dump files (keeps the folder XLA writes to)."""
  for p in glob.glob(os.path.join(DUMP_DIR, '*')):
    if os.path.isfile(p):
      os.remove(p)
    else:
      shutil.rmtree(p, ignore_errors=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      description='Measure the step graph of the report model and print JSON.')
  parser.add_argument('--layers', type=int)
  parser.add_argument('--world-size', type=int, default=1)
  parser.add_argument('--flatten', type=int, choices=(0, 1), default=1)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--explain', type=int, choices=(0, 1), default=0)
  parser.add_argument('--feature', choices=FEATURES, default='plain')
  parser.add_argument(
      '--model',
      metavar='PACKAGE.MODULE:FUNCTION',
      help='measure this model instead of the report\'s (see '
      'model_step_stats); --layers is passed on to it if given')
  parser.add_argument('--optimizer', choices=('adamw', 'sgd'), default='adamw')
  args = parser.parse_args(argv)
  try:
    if args.model:
      stats = model_step_stats(
          args.model,
          args.world_size,
          args.steps,
          num_layers=args.layers,
          optimizer=args.optimizer,
          flatten_parameters=bool(args.flatten))
    else:
      stats = report_model_step_stats(
          args.layers or 2,
          args.world_size,
          args.steps,
          explain=bool(args.explain),
          feature=args.feature,
          flatten_parameters=bool(args.flatten))
  except ValueError as e:
    sys.exit(f'error: {e}')
  out = dataclasses.asdict(stats)
  out['fsdp_file'] = fsdp_module.__file__
  print(json.dumps(out))
  if _DUMP_DIR_IS_TEMPORARY:  # (not a folder the user chose)
    cleanup_dumps()


if __name__ == '__main__':
  main()
