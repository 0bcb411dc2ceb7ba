#!/usr/bin/env python3
"""Memory of the FSDP training step on the TPU compiler and on XLA:GPU.

XLA:CPU's buffer assignment (``fsdp_memory_utils``) is a fast check, but the
compilers that run FSDP for users schedule and fuse differently. Both can
run here without a chip: the TPU compiler (libtpu, through jax's
compile-only client on a TPU topology) and XLA:GPU (jax's CUDA plugin
compiling for one of XLA's GPU target specs).

A step is traced once per variant (stock or fixed FSDP, flatten_parameters
False or True) at world size 8 with real collectives: 8 CPU devices
(``PJRT_DEVICE=CPU CPU_NUM_DEVICES=8``, ``torch_xla.launch``: on CPU one
process with a thread per device) trace it and
XLA:CPU dumps the step module (the one with a reduce-scatter) before
compiling it. Executing its collectives may hang on CPU, so the tracing
processes are ended as soon as that dump is complete. The module is then
compiled deviceless, each compile in a process of its own (libtpu serves one
process at a time), and the figure is the compiler's own allocation for the
step: argument + output + temp - alias bytes
(``get_compiled_memory_stats()``).

  python benchmarks/fsdp_compiler_memory.py --layers 2 4
  python benchmarks/fsdp_compiler_memory.py --targets tpu-v5e gpu-a100 --json out.json
  python benchmarks/fsdp_compiler_memory.py --unpinned --layers 2 4 8

Needs ``jax[tpu]==0.10.2`` for the TPU targets and ``jax-cuda12-plugin==0.10.2
jax-cuda12-pjrt==0.10.2`` for the GPU ones (no NVIDIA libraries needed).
"""

import argparse
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
sys.path.insert(0, _HERE)
import fsdp_real_models  # noqa: E402
from fsdp_real_models import LARGE  # noqa: E402

# XLA's descriptions of the GPUs (copies that jaxlib 0.10.2 parses)
GPU_SPECS_DIR = os.environ.get('FSDP_GPU_TARGET_SPECS',
                               os.path.join(_HERE, 'gpu_target_specs'))

# name: (platform, topology name or GPU target spec file)
TARGETS = {
    'tpu-v5e': ('tpu', 'v5e:2x4'),
    'tpu-v4': ('tpu', 'v4:2x2x1'),
    'tpu-v5p': ('tpu', 'v5p:2x2x2'),
    'tpu-v6e': ('tpu', 'v6e:2x4'),
    'gpu-a100': ('cuda', 'a100_sxm_80.txtpb'),
    'gpu-h100': ('cuda', 'h100_sxm.txtpb'),
}
DEFAULT_TARGETS = ('tpu-v5e', 'gpu-a100', 'gpu-h100')
WORLD_SIZE = 8
MB = 1e6
# Changes with what _trace_worker traces (a key of the trace cache).
TRACE_VERSION = 6
# The report's batch (per device) and the model's width.
_BATCH, _HIDDEN = 64, 1280


def progress(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Availability of the compilers.
# ---------------------------------------------------------------------------


def missing(target: str) -> Optional[str]:
  """Why ``target`` cannot be compiled for here, or None if it can."""
  platform, spec = TARGETS[target]
  if importlib.util.find_spec('jax') is None:
    return ('jax is not installed: pip install "jax[tpu]==0.10.2" '
            'jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2')
  if platform == 'tpu' and importlib.util.find_spec('libtpu') is None:
    return 'libtpu is not installed: pip install "jax[tpu]==0.10.2"'
  if platform == 'cuda':
    if importlib.util.find_spec('jax_plugins.xla_cuda12') is None:
      return ('the CUDA plugin is not installed: pip install '
              'jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2')
    if not os.path.exists(os.path.join(GPU_SPECS_DIR, spec)):
      return (f'no GPU target spec {spec} in {GPU_SPECS_DIR} '
              '(set FSDP_GPU_TARGET_SPECS)')
  return None


# ---------------------------------------------------------------------------
# Tracing: the step module at world size 8 with real collectives.
# ---------------------------------------------------------------------------

# Transformers models at a realistic width (``fsdp_real_models.LARGE``): at
# hidden 256 the TPU compiler keeps small buffers in on-chip memory and the
# HBM figure says little.
TRANSFORMERS = ('llama', 'gpt2', 't5', 'bert', 'qwen2')
# T5 with 4 heads, 2 layers: its relative attention bias is [32, 4] (for the
# tests).
T5_4_HEADS = 't5-4-heads'
# The report model with a [32, 4] embedding in each Layer, T5's relative
# attention bias with 4 heads (``fsdp_memory_utils.BiasedLayer``; for the
# tests).
REPORT_32X4 = 'report-32x4'
REPORT_MODELS = ('report', REPORT_32X4)
# T5 with all four vocabulary matrices separate: the head, the shared
# embedding and the encoder's and decoder's embeddings (pytorch/xla#5464's
# T5; transformers makes the last two the shared one's, and ``t5`` unties
# only the head).
T5_FOUR = 't5-four'
# what --models takes
MODELS = REPORT_MODELS + TRANSFORMERS + (T5_FOUR,)


def _size(name: str, layers: Optional[int] = None) -> fsdp_real_models.Size:
  size = LARGE._replace(heads=4, layers=2) if name == T5_4_HEADS else LARGE
  return size._replace(layers=layers) if layers else size


def build_transformer(name: str, layers: Optional[int] = None):
  """(module returning the language-modelling loss, input ids, layer
  classes to wrap as FSDP units) of a transformers model, random weights
  (``layers`` deep, default ``LARGE.layers``); also ``T5_4_HEADS`` and
  ``T5_FOUR``."""
  builder = 't5' if name in (T5_4_HEADS, T5_FOUR) else name
  if builder not in TRANSFORMERS:
    raise ValueError(f'unknown model {name!r}: {", ".join(TRANSFORMERS)}')
  loss, ids, layer_classes = getattr(fsdp_real_models, builder)(
      size=_size(name, layers))
  if name == T5_FOUR:
    import torch
    t5 = loss.model
    for stack in (t5.encoder, t5.decoder):
      stack.embed_tokens = torch.nn.Embedding.from_pretrained(
          t5.shared.weight.detach().clone(), freeze=False)
  return loss, ids, layer_classes


def _trace_worker(index: int, model_name: str, layers: int, flatten: bool,
                  pin_layout: bool) -> None:
  """One device's training step (``torch_xla.launch``): the report model
  (SGD, batch 64) or a transformers model (AdamW)."""
  sys.path.insert(0, os.path.join(_REPO, 'test'))
  import functools
  import torch
  import torch_xla
  import fsdp_memory_utils as mu
  design = os.environ.get('FSDP_DESIGN')
  if design:
    import fsdp_design_sweep
    fsdp_design_sweep.apply(design)
  device = torch_xla.device()
  if model_name in REPORT_MODELS:
    model = mu.wrap_report_model(
        layers,
        layer_cls=mu.BiasedLayer if model_name == REPORT_32X4 else mu.Layer,
        flatten_parameters=flatten,
        pin_layout_in_collective_ops=pin_layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def loss():
      # A batch from the host, as a data loader's: an argument of the step.
      # (Made on the device by random ops instead, it changes what the TPU
      # compiler keeps in on-chip memory: F reads 44 MB less on TPU v6e.)
      return model(torch.randn(_BATCH, _HIDDEN).to(device)).sum()
  else:
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    torch.manual_seed(0)
    module, ids, classes = build_transformer(model_name, layers)
    model = FSDP(
        module,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls=classes),
        flatten_parameters=flatten,
        pin_layout_in_collective_ops=pin_layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = ids.to(device)

    def loss():
      return model(ids)

  names = os.environ.get('FSDP_TRACE_NAMES')
  if names:
    # What a buffer of each shape may be, for --explain: the same on every
    # device, written by each (one of them may die once another's step is
    # dumped), before the step (the tracing processes are then ended).
    with open(f'{names}.{index}.tmp', 'w') as f:
      json.dump(mu.buffer_names(model), f)
    os.replace(f'{names}.{index}.tmp', names)

  # (a function, so that the batch and the activations are no longer
  # referenced at the sync and do not become graph outputs)
  def step():
    optimizer.zero_grad()
    loss().backward()
    optimizer.step()

  step()
  torch_xla.sync()


def _check_fixed_fsdp_imported() -> None:
  """Raise unless torch_xla's FSDP is this checkout's (an install of another
  checkout, or none, would trace stock FSDP as the fixed one)."""
  from torch_xla.distributed.fsdp import xla_fully_sharded_data_parallel as m
  name = 'xla_fully_sharded_data_parallel.py'
  with open(m.__file__, 'rb') as imported, open(
      os.path.join(_REPO, 'torch_xla', 'distributed', 'fsdp', name),
      'rb') as checkout:
    if imported.read() != checkout.read():
      raise RuntimeError(
          f'tracing the fixed FSDP, but torch_xla imports {m.__file__}, not '
          f"this checkout's: install it (pip install -e {_REPO})")


def _trace_main(model_name: str, layers: int, flatten: bool,
                pin_layout: bool) -> None:
  import torch_xla
  if os.environ.get('TORCH_XLA_FSDP_OVERLAY') == '1':
    _check_fixed_fsdp_imported()  # (once, before the devices' workers)
  torch_xla.launch(
      _trace_worker, args=(model_name, layers, flatten, pin_layout))


# A module is complete when its ENTRY computation (the last) has ended.
_COMPLETE_RE = re.compile(r'\nENTRY [\s\S]*\n  ROOT [^\n]*\n\}\s*$')


def _step_module(dump_dir: str, world_size: int) -> Optional[str]:
  """The dumped step module's HLO text once it is completely written.

  At world size 1 (where FSDP reduce-scatters nothing) it is the largest
  module, read once the tracing process has ended.
  """
  texts = []
  for path in sorted(
      glob.glob(os.path.join(dump_dir, '*.before_optimizations.txt'))):
    with open(path) as f:
      text = f.read()
    if not _COMPLETE_RE.search(text):
      continue
    if world_size > 1 and ' reduce-scatter(' in text:
      return text
    texts.append(text)
  if world_size == 1 and texts:
    return max(texts, key=len)
  return None


def names_path(hlo_path: str) -> str:
  """Where ``trace`` keeps what a buffer of each shape of the traced model
  may be (``fsdp_memory_utils.buffer_names``), for ``explain``."""
  return hlo_path + '.names.json'


def cache_dir() -> str:
  return os.environ.get(
      'FSDP_COMPILER_MEMORY_CACHE',
      os.path.join(tempfile.gettempdir(), 'fsdp_compiler_memory'))


def stock_by_default() -> bool:
  """Whether this process's environment asks for stock torch_xla's FSDP
  (``TORCH_XLA_FSDP_OVERLAY=0``): then the "fixed" variant is stock."""
  return os.environ.get('TORCH_XLA_FSDP_OVERLAY', '1') == '0'


def trace(stock: Optional[bool],
          flatten: bool,
          layers: int,
          out_dir: Optional[str] = None,
          timeout: float = 600.0,
          world_size: int = WORLD_SIZE,
          model: str = 'report',
          pin_layout: bool = True,
          design: str = '') -> str:
  """Path of the step module's HLO text (``before_optimizations``) for one
  variant, traced at ``world_size`` (8: with real collectives; 1: the
  configuration of pytorch/xla#5464). ``model``: one of ``REPORT_MODELS``
  (``layers`` deep) or of ``TRANSFORMERS`` (``layers`` deep, or
  ``LARGE.layers`` if None).

  ``stock``: stock torch_xla's FSDP, or this checkout's fixed one; None
  follows ``TORCH_XLA_FSDP_OVERLAY`` (``stock_by_default``).
  ``pin_layout``: FSDP's ``pin_layout_in_collective_ops`` (False: real
  all-gathers, see ``parse_args``' --unpinned). ``design``: a variant of
  the fixed FSDP's design (``fsdp_design_sweep``). Traces are kept
  in ``out_dir`` (default ``cache_dir()``) under a name that changes with
  the FSDP files traced.
  """
  if stock is None:
    stock = stock_by_default()
  # A trace stays valid while the FSDP files it ran (stock's, or the
  # checkout's fixed ones), the model and the tracing code stay the same.
  # (found without importing torch_xla, which would start its runtime here)
  stock_dir = os.path.join(
      os.path.dirname(importlib.util.find_spec('torch_xla').origin),
      'distributed', 'fsdp')
  fsdp_dir = stock_dir if stock else os.path.join(_REPO, 'torch_xla',
                                                  'distributed', 'fsdp')
  digest = hashlib.sha256(
      f"{TRACE_VERSION} {importlib.metadata.version('torch-xla')}".encode())
  # torch_xla's switch that leaves its ordering token out of collectives'
  # inputs changes the traced step
  if os.environ.get('DISABLE_NUMERIC_CC_TOKEN'):
    digest.update(b'DISABLE_NUMERIC_CC_TOKEN=' +
                  os.environ['DISABLE_NUMERIC_CC_TOKEN'].encode())
  for path in sorted(glob.glob(os.path.join(fsdp_dir, '*.py'))) + [
      os.path.join(_REPO, 'test', 'fsdp_memory_utils.py')
  ]:
    with open(path, 'rb') as f:
      digest.update(f.read())
  if model not in REPORT_MODELS:
    layers = layers or _size(model).layers
  if design:
    digest.update(design.encode())
    with open(os.path.join(_HERE, 'fsdp_design_sweep.py'), 'rb') as f:
      digest.update(f.read())
  tag = '-' + re.sub(r'[^\w.]+', '_', design) if design else ''
  name = (f"{model}-w{world_size}-l{layers}-{'stock' if stock else 'fixed'}-"
          f"{'T' if flatten else 'F'}{'' if pin_layout else '-unpinned'}{tag}-"
          f'{digest.hexdigest()[:12]}.hlo.txt')
  out_dir = out_dir or cache_dir()
  out = os.path.join(out_dir, name)
  # (a trace kept from before the buffer names were written is made again)
  if os.path.exists(out) and os.path.exists(names_path(out)):
    return out
  os.makedirs(out_dir, exist_ok=True)
  what = (f"{model} model, {layers} layers, {'stock' if stock else 'fixed'} "
          f"flatten={flatten}")
  what += f"{'' if pin_layout else ', unpinned'}, world size {world_size}"
  what += f', design {design}' if design else ''
  progress(f'trace: {what} ...')
  start = time.time()
  dump_dir = tempfile.mkdtemp(prefix='fsdp_trace_dump_')
  # (a file: a pipe that nobody reads while waiting could fill and stop it)
  err = tempfile.TemporaryFile()
  env = dict(os.environ)
  env.update(
      PJRT_DEVICE='CPU',
      CPU_NUM_DEVICES=str(world_size),
      TORCH_XLA_FSDP_OVERLAY='0' if stock else '1',
      # the trace is all that is wanted: no barrier pass flags of the
      # CPU helper, only the dump
      XLA_FLAGS=f'--xla_dump_to={dump_dir} '
      '--xla_disable_hlo_passes=cse_barrier_expander',
      FSDP_TRACE_NAMES=names_path(out),
      FSDP_DESIGN=design)
  env.pop('XLA_HLO_DEBUG', None)
  proc = subprocess.Popen([
      sys.executable,
      os.path.abspath(__file__), '_trace', '--model', model, '--layers',
      str(layers), '--flatten',
      str(int(flatten)), '--pin-layout',
      str(int(pin_layout))
  ],
                          env=env,
                          stdout=subprocess.DEVNULL,
                          stderr=err,
                          start_new_session=True)
  text = None
  try:
    while time.time() - start < timeout:
      ended = proc.poll() is not None
      if world_size > 1 or ended:
        text = _step_module(dump_dir, world_size)
      if text is not None or ended:
        break
      time.sleep(0.5)
    # (each device writes the buffer names before its step, but one's step
    # module may be dumped before any has written them)
    names_by = time.time() + 60
    while (text is not None and proc.poll() is None and
           not os.path.exists(names_path(out)) and time.time() < names_by):
      time.sleep(0.5)
  finally:
    # The step's collectives may never complete on CPU: end the tracing
    # processes (the session of the child, started above) instead of
    # waiting for them.
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    shutil.rmtree(dump_dir, ignore_errors=True)
    err.seek(0)
    err_text = err.read().decode(errors='replace')
    err.close()
  if text is None:
    raise RuntimeError(
        f'tracing {what} gave no step module'
        f"{' with a reduce-scatter' if world_size > 1 else ''} (exit code "
        f'{proc.returncode}):\n{err_text[-3000:]}')
  with open(out + '.tmp', 'w') as f:
    f.write(text)
  os.replace(out + '.tmp', out)
  progress(f'trace: {what}: {time.time() - start:.0f} s')
  return out


# ---------------------------------------------------------------------------
# Compiling deviceless.
# ---------------------------------------------------------------------------

# (each donor is `(parameter, {shape index})`)
_DONOR_RE = re.compile(r'buffer_donor=\{((?:[^{}]|\{[^{}]*\})*)\}')
_REPLICAS_RE = re.compile(r'replica_count=(\d+)')


def buffer_donors(hlo_text: str) -> List[int]:
  """The parameters torch_xla donates (the module header's ``buffer_donor``:
  its state updated in place)."""
  header = hlo_text.split('\n', 1)[0]
  m = _DONOR_RE.search(header)
  if m is None:
    return []
  return [int(p) for p in re.findall(r'\((\d+),', m.group(1))]


def _to_mlir(hlo_text: str):
  """The HLO text as an MLIR module, its buffer donors restored as aliases.

  The HLO -> MLIR conversion drops ``buffer_donor``; without it the
  compiler counts the donated state (parameters, gradients) once as
  arguments and again as outputs. Each donor becomes ``tf.aliasing_output``
  of the first output of its type that no other donor took, which is what
  the runtime does with a donated buffer.
  """
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib import xla_client
  from jax._src.lib.mlir import ir
  from jaxlib import _hlo
  module = _hlo.hlo_module_from_text(hlo_text)
  computation = _hlo.XlaComputation(module.as_serialized_hlo_module_proto())
  text = xla_client._xla.mlir.xla_computation_to_mlir_module(computation)
  donors = buffer_donors(hlo_text)
  context = jax_mlir.make_ir_context()
  with context:
    mlir_module = ir.Module.parse(text)
    main = next(
        op for op in mlir_module.body.operations
        if ir.StringAttr(op.attributes['sym_name']).value == 'main')
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes['function_type']).value)
    inputs = [str(t) for t in ftype.inputs]
    results = [str(t) for t in ftype.results]
    if 'arg_attrs' in main.attributes:
      arg_attrs = [
          dict((a.name, a.attr)
               for a in ir.DictAttr(d))
          for d in ir.ArrayAttr(main.attributes['arg_attrs'])
      ]
    else:
      arg_attrs = [{} for _ in inputs]
    taken = set()
    aliased = 0
    for p in donors:
      k = next((k for k, t in enumerate(results)
                if t == inputs[p] and k not in taken), None)
      if k is None:
        continue
      taken.add(k)
      aliased += 1
      arg_attrs[p]['tf.aliasing_output'] = ir.IntegerAttr.get(
          ir.IntegerType.get_signless(32), k)
    main.attributes['arg_attrs'] = ir.ArrayAttr.get(
        [ir.DictAttr.get(a) for a in arg_attrs])
  return context, mlir_module, len(donors), aliased


def _compile_main(target: str, hlo_path: str, dump_to: str = '') -> None:
  """Compile one HLO module for ``target``; print its memory stats (JSON)."""
  platform, spec = TARGETS[target]
  import jax
  jax.config.update('jax_enable_x64', True)
  from jax.experimental import topologies
  from jax._src.lib import xla_client
  with open(hlo_path) as f:
    hlo_text = f.read()
  m = _REPLICAS_RE.search(hlo_text.split('\n', 1)[0])
  replicas = int(m.group(1)) if m else 1
  if platform == 'tpu':
    topo = topologies.get_topology_desc(topology_name=spec, platform='tpu')
  else:
    with open(os.path.join(GPU_SPECS_DIR, spec)) as f:
      target_config = f.read()
    topo = topologies.get_topology_desc(
        platform='cuda',
        topology_name='',
        topology=f'1x1x{max(replicas, 1)}',
        target_config=target_config)
  devices = list(topo.devices)[:replicas]
  if len(devices) < replicas:
    raise SystemExit(f'{target} ({spec}) has {len(devices)} devices, the '
                     f'module needs {replicas}')
  context, module, num_donors, aliased = _to_mlir(hlo_text)
  import numpy as np
  options = xla_client.CompileOptions()
  options.num_replicas = replicas
  options.num_partitions = 1
  options.device_assignment = xla_client.DeviceAssignment.create(
      np.arange(replicas).reshape(replicas, 1))
  if dump_to:
    # the compiler's buffer assignment and memory-usage report: what is
    # live at its peak
    options.executable_build_options.debug_options.xla_dump_to = dump_to
  start = time.time()
  with context:
    executable = devices[0].client.compile(
        module,
        executable_devices=xla_client.DeviceList(tuple(devices)),
        compile_options=options)
  stats = executable.get_compiled_memory_stats()
  out = dict(
      target=target,
      spec=spec,
      argument_bytes=stats.argument_size_in_bytes,
      output_bytes=stats.output_size_in_bytes,
      alias_bytes=stats.alias_size_in_bytes,
      temp_bytes=stats.temp_size_in_bytes,
      generated_code_bytes=stats.generated_code_size_in_bytes,
      peak_bytes=getattr(stats, 'peak_memory_in_bytes', None),
      donors=num_donors,
      aliased=aliased,
      compile_seconds=time.time() - start)
  # (the compiler's own cost model: what a step reads and writes, and its
  # flops; no chip runs it here)
  try:
    cost = executable.cost_analysis()
  except Exception:  # (XLA:GPU's compile-only client has none)
    cost = None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  cost = cost or {}
  out['flops'] = cost.get('flops')
  out['bytes_accessed'] = cost.get('bytes accessed')
  out['total_bytes'] = (
      out['argument_bytes'] + out['output_bytes'] + out['temp_bytes'] -
      out['alias_bytes'])
  print(json.dumps(out))


def explain(dump_dir: str, names_path: Optional[str] = None) -> dict:
  """What a compiler keeps in device memory (HBM; not on-chip memories) at
  the peak of a step it compiled with ``dump_to=dump_dir``: its buffer
  assignment and live ranges, read as ``fsdp_memory_utils`` reads XLA:CPU's
  (each region counted once), and each buffer described by shape (what it
  may be in the traced model, from ``names_path``: ``trace`` writes it
  beside the HLO, ``names_path``), op and instruction. A buffer of another element type or
  shape with as many elements as a known one (a bfloat16 copy, a reshape)
  says so."""
  sys.path.insert(0, os.path.join(_REPO, 'test'))
  import fsdp_memory_utils as mu

  def one(pattern):
    paths = glob.glob(os.path.join(dump_dir, '*' + pattern))
    if len(paths) != 1:
      raise RuntimeError(f'expected one *{pattern} in {dump_dir}, found '
                         f'{len(paths)}')
    with open(paths[0]) as f:
      return f.read()

  assignment = one('after_optimizations-buffer-assignment.txt')
  # (allocations of other memory spaces, e.g. a TPU's VMEM, are marked
  # "color N")
  blocks = re.split(r'(?m)^(?=allocation \d+: )', assignment)
  hbm = ''.join(
      b for b in blocks
      if not re.match(r'allocation \d+: [^\n]*'
                      r', color [1-9]', b))
  live_ranges = one('after_optimizations-live-range.txt')
  peak, live = mu.parse_resident_peak(hbm + live_ranges)
  names = {}
  if names_path and os.path.exists(names_path):
    with open(names_path) as f:
      names = json.load(f)
  names = {shape: list(dict.fromkeys(what)) for shape, what in names.items()}
  by_numel = {}
  for shape, what in names.items():
    by_numel.setdefault(_numel(shape),
                        []).extend(f'{w} (as {shape})' for w in what)
  hlo = one('after_optimizations.txt')
  buffers = mu.explain_buffers(live, hlo, names)
  for b in buffers:
    m = re.fullmatch(r'(.+)\{(\d+)\}', b['buffer'])
    if b['shape'] == '?' and m:
      # an element of a tuple (e.g. of an asynchronous collective)
      t = re.search(r'%' + re.escape(m.group(1)) + r' = \((.*?)\) ', hlo)
      elements = re.findall(r'\w+\[[\d,]*\]', t.group(1)) if t else []
      if int(m.group(2)) < len(elements):
        b['shape'] = elements[int(m.group(2))]
    b['shape'] = re.sub(r'\{[^{}]*\}', '', b['shape'])
    if not b['may_be']:
      b['may_be'] = names.get(b['shape']) or by_numel.get(
          _numel(b['shape']), [])
  # (the heap of temporaries in HBM that the buffer assignment lays out; the
  # TPU compiler's temp_size_in_bytes can be larger)
  heap = sum(
      int(size) for size in re.findall(
          r'(?m)^allocation \d+: size (\d+), preallocated-temp:', hbm))
  return dict(peak_bytes=peak, buffers=buffers, heap_bytes=heap)


def _numel(shape: str) -> int:
  """Elements of an array shape such as ``bf16[12800,128]`` (0 if none)."""
  m = re.fullmatch(r'\w+\[([\d,]*)\]', shape)
  if m is None:
    return 0
  n = 1
  for d in filter(None, m.group(1).split(',')):
    n *= int(d)
  return n


def compile_env(target: str) -> Dict[str, str]:
  """The environment of a compiling process."""
  env = dict(os.environ)
  for var in ('XLA_FLAGS', 'PJRT_DEVICE', 'CPU_NUM_DEVICES'):
    env.pop(var, None)
  # no CUDA client (there is no GPU); the compile-only clients need none
  env['JAX_PLATFORMS'] = 'cpu'
  if TARGETS[target][0] == 'cuda':
    # Without a GPU there is nothing to autotune on: dots take Triton's
    # default configuration.
    env['XLA_FLAGS'] = '--xla_gpu_autotune_level=0'
  else:
    # quiets libtpu's search for TPU hosts
    env.setdefault('TPU_ACCELERATOR_TYPE', 'v5litepod-8')
    env.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
    # several compiling processes at a time (run_tests.sh runs two files)
    env.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  return env


def compile_hlo(hlo_path: str,
                target: str,
                timeout: float = 900.0,
                dump_to: Optional[str] = None) -> dict:
  """Memory stats of compiling ``hlo_path`` for ``target``, in a process of
  its own; with ``dump_to``, the compiler's dumps (buffer assignment,
  memory-usage report on TPU) go to that folder."""
  why = missing(target)
  if why:
    raise RuntimeError(f'cannot compile for {target}: {why}')
  start = time.time()
  out = subprocess.run([
      sys.executable,
      os.path.abspath(__file__), '_compile', '--target', target, '--hlo',
      hlo_path, '--dump-to', dump_to or ''
  ],
                       env=compile_env(target),
                       capture_output=True,
                       text=True,
                       timeout=timeout)
  if out.returncode != 0:
    raise RuntimeError(f'compiling {os.path.basename(hlo_path)} for {target} '
                       f'failed:\n{out.stderr[-4000:]}')
  stats = json.loads(out.stdout.strip().splitlines()[-1])
  progress(f'compile: {os.path.basename(hlo_path)} for {target}: '
           f"{stats['total_bytes'] / MB:.1f} MB, {time.time() - start:.0f} s")
  return stats


def main(argv=None) -> None:
  if argv is None:
    argv = sys.argv[1:]
  if argv and argv[0] == '_trace':
    p = argparse.ArgumentParser()
    p.add_argument('--model')
    p.add_argument('--layers', type=int)
    p.add_argument('--flatten', type=int)
    p.add_argument('--pin-layout', type=int, default=1)
    a = p.parse_args(argv[1:])
    _trace_main(a.model, a.layers, bool(a.flatten), bool(a.pin_layout))
    return
  if argv and argv[0] == '_compile':
    p = argparse.ArgumentParser()
    p.add_argument('--target')
    p.add_argument('--hlo')
    p.add_argument('--dump-to', default='')
    a = p.parse_args(argv[1:])
    _compile_main(a.target, a.hlo, a.dump_to)
    return
  args = parse_args(argv)
  results = measure(
      args.layers,
      args.targets,
      args.out_dir,
      args.world_size,
      args.models,
      args.dump_to,
      pin_layout=not args.unpinned,
      live=args.live)
  print_table(results, args.targets, args.world_size)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=1)


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='\n'.join(__doc__.splitlines()[1:]))
  parser.add_argument(
      '--models',
      nargs='+',
      default=['report'],
      choices=MODELS,
      metavar='MODEL',
      help=f"report (the default), {REPORT_32X4} (with a [32, 4] relative "
      f"position bias in each Layer) or of {', '.join(TRANSFORMERS)}: "
      f'transformers at hidden {LARGE.hidden}, {LARGE.layers} layers, '
      f'{LARGE.heads} heads, vocabulary {LARGE.vocab}, batch {LARGE.batch} x '
      f'{LARGE.tokens}; {T5_FOUR}: T5 with its embeddings and head separate')
  parser.add_argument(
      '--layers',
      type=int,
      nargs='+',
      default=[2, 4],
      metavar='N',
      help='depths of the report model')
  parser.add_argument(
      '--targets',
      nargs='+',
      choices=sorted(TARGETS),
      metavar='TARGET',
      help=f"of {', '.join(TARGETS)} (default: "
      f"{', '.join(DEFAULT_TARGETS)}, those installed)")
  parser.add_argument(
      '--out-dir',
      help='where the traced step modules are kept (default: '
      '$FSDP_COMPILER_MEMORY_CACHE or a folder in the temp dir)')
  parser.add_argument(
      '--world-size',
      type=int,
      choices=(1, WORLD_SIZE),
      default=WORLD_SIZE,
      help=f'{WORLD_SIZE}: real collectives on {WORLD_SIZE} CPU devices; 1: '
      'the configuration of pytorch/xla#5464')
  parser.add_argument(
      '--dump-to',
      metavar='DIR',
      help="the compilers' dumps, DIR/TARGET/STEP MODULE/: buffer "
      'assignment (and on TPU a memory-usage report) of each step')
  parser.add_argument(
      '--unpinned',
      action='store_true',
      help='every variant with pin_layout_in_collective_ops=False: real '
      'all-gathers (pinned, torch_xla gathers with an all-reduce of the '
      'zero-padded full-size buffer)')
  parser.add_argument(
      '--live',
      action='store_true',
      help='also what is resident at each compiler\'s peak (its buffer '
      'assignment and live ranges): the live column, in units above F')
  parser.add_argument('--json', help='write the results there')
  args = parser.parse_args(argv)
  if min(args.layers) < 1:
    parser.error('--layers must be >= 1')
  if (set(args.models) - set(REPORT_MODELS) and
      importlib.util.find_spec('transformers') is None):
    parser.error('the transformers models need transformers: pip install '
                 '-e ".[models]"')
  if args.targets is None:
    args.targets = [t for t in DEFAULT_TARGETS if missing(t) is None]
    for t in DEFAULT_TARGETS:
      if missing(t):
        progress(f'skipping {t}: {missing(t)}')
  else:
    for t in args.targets:
      if missing(t):
        parser.error(f'{t}: {missing(t)}')
  if not args.targets:
    parser.error('no compiler to measure with')
  return args


# (stock, flatten) of the variants compared: F, stock T, fixed T
VARIANTS = {
    'F': (False, False),
    'stock T': (True, True),
    'fixed T': (False, True)
}


def measure(layers: List[int],
            targets: List[str],
            out_dir: Optional[str] = None,
            world_size: int = WORLD_SIZE,
            models=('report',),
            dump_to: Optional[str] = None,
            pin_layout: bool = True,
            live: bool = False) -> List[dict]:
  """Compile every variant of each model (the report model at each depth)
  for each target; one dict of memory stats per compile (with the folder of
  the compiler's dumps, ``dump_dir``, under ``dump_to``). ``live``: also,
  for F and fixed T, ``live_bytes``, what is resident at the compiler's peak
  (``explain``)."""
  results = []
  for model in models:
    for n in (layers if model in REPORT_MODELS else [LARGE.layers]):
      for variant, (stock, flatten) in VARIANTS.items():
        hlo = trace(
            stock,
            flatten,
            n,
            out_dir,
            world_size=world_size,
            model=model,
            pin_layout=pin_layout)
        with open(hlo) as f:
          gathered = largest_gather_bytes(f.read())
        for target in targets:
          # (a folder per target and step module)
          dump_dir = dump_to and os.path.join(
              dump_to, target,
              os.path.basename(hlo)[:-len('.hlo.txt')])
          explained = live and variant != 'stock T'
          # (XLA:GPU's dumps are large: kept only under dump_to)
          scratch = (
              tempfile.mkdtemp(prefix='fsdp_compiler_dump_')
              if explained and not dump_dir else None)
          dumps = dump_dir or scratch
          stats = compile_hlo(hlo, target, dump_to=dumps)
          if explained:
            stats['live_bytes'] = explain(dumps, names_path(hlo))['peak_bytes']
          if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
          results.append(
              dict(
                  stats,
                  model=model,
                  variant=variant,
                  layers=n,
                  pin_layout=pin_layout,
                  hlo=hlo,
                  dump_dir=dump_dir,
                  largest_gather_bytes=gathered))
  return results


_GATHER_RE = re.compile(r'^\s+%\S+ = (.*?) all-(?:reduce|gather)\(', re.M)
_REDUCE_SCATTER_RE = re.compile(r'^\s+%\S+ = (.*?) reduce-scatter\(', re.M)


def largest_gather_bytes(hlo_text: str, world_size: int = WORLD_SIZE) -> int:
  """The largest parameter a step gathers (with flatten_parameters=True a
  flat parameter: one unit), in bytes: the largest f32 array that an
  all-gather returns (torch_xla's all-gather with a pinned layout, FSDP's,
  is an all-reduce) or that a reduce-scatter reduces (``world_size`` times
  its result: a flat parameter gathered in pieces is reduce-scattered
  whole). At world size 1, where nothing is gathered, the largest flat f32
  argument of the step (a whole flat parameter)."""
  shapes = [(m.group(1), 1) for m in _GATHER_RE.finditer(hlo_text)]
  shapes += [
      (m.group(1), world_size) for m in _REDUCE_SCATTER_RE.finditer(hlo_text)
  ]
  if not shapes:
    entry = re.search(r'^ENTRY [^(]*\((.*)\) ->', hlo_text, re.M)
    shapes = [(s, 1) for s in re.findall(r'f32\[\d+\]',
                                         entry.group(1) if entry else '')]
  sizes = [0]
  for shape, times in shapes:
    for dims in re.findall(r'f32\[([\d,]+)\]', shape):
      n = times
      for d in dims.split(','):
        n *= int(d)
      sizes.append(4 * n)
  return max(sizes)


def print_table(results: List[dict],
                targets: List[str],
                world_size: int = WORLD_SIZE) -> None:
  """F, stock T and fixed T per model and depth for each target, and the
  report model's growth per layer."""
  find = {
      (r['model'], r['layers'], r['target'], r['variant']): r for r in results
  }
  pinned = all(r.get('pin_layout', True) for r in results)
  print(f'\nWorld size {world_size}'
        f"{', real collectives' if world_size > 1 else ''}"
        f"{'' if pinned else ', pin_layout_in_collective_ops=False'}; "
        'MB = argument + output + temp - alias;\nunits = (fixed T - F) / '
        'the largest flat parameter the fixed step gathers (unit MB)')
  live = all('live_bytes' in r for r in results if r['variant'] != 'stock T')
  if live:
    print('live: units above F of what is resident at the compiler\'s peak')
  cols = [('model', 11), ('layers', 6), ('target', 9), ('F', 8), ('stock T', 8),
          ('fixed T', 8), ('fixed/F', 7), ('unit MB', 7), ('units', 6)]
  cols += [('live', 6)] if live else []
  print('  '.join(f'{c:>{w}}' for c, w in cols))
  configs = list(dict.fromkeys((r['model'], r['layers']) for r in results))
  for model, n in configs:
    for target in targets:
      f, st, fx = (find[(model, n, target, v)]['total_bytes'] for v in VARIANTS)
      unit = find[(model, n, target, 'fixed T')]['largest_gather_bytes']
      row = [
          model, n, target, f'{f / MB:.1f}', f'{st / MB:.1f}', f'{fx / MB:.1f}',
          f'{fx / f:.2f}', f'{unit / MB:.1f}',
          f'{(fx - f) / unit:.2f}' if unit else '-'
      ]
      if live:
        f_live, fx_live = (
            find[(model, n, target, v)]['live_bytes'] for v in ('F', 'fixed T'))
        row.append(f'{(fx_live - f_live) / unit:.2f}' if unit else '-')
      print('  '.join(f'{v:>{w}}' for v, (_, w) in zip(row, cols)))
  depths = sorted(n for model, n in configs if model == 'report')
  if len(depths) > 1:
    lo, hi = depths[0], depths[-1]
    print(f'\nReport model, growth per layer from {lo} to {hi} layers, in '
          'F\'s growth:')
    for target in targets:
      growth = {
          v: (find[('report', hi, target, v)]['total_bytes'] -
              find[('report', lo, target, v)]['total_bytes']) /
             (hi - lo) for v in VARIANTS
      }
      print(f"  {target}: F {growth['F'] / MB:.1f} MB/layer, stock T "
            f"{growth['stock T'] / growth['F']:.2f}x, fixed T "
            f"{growth['fixed T'] / growth['F']:.2f}x")


if __name__ == '__main__':
  main()
