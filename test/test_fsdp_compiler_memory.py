"""Memory of the FSDP step on the compilers that run it: TPU and XLA:GPU.

The report model's training step is traced at world size 8 with real
collectives (8 CPU devices) and compiled deviceless by the TPU compiler (TPU
v5e, through jax's compile-only client and libtpu) and by XLA:GPU (H100 SXM
and A100 80GB, jax's CUDA plugin and XLA's GPU target specs); the figure is
the compiler's own allocation for the step, argument + output + temp - alias
bytes (``benchmarks/fsdp_compiler_memory.py``).

On both compilers, between 2 and 4 layers, stock flatten_parameters=True grows
by many times what flatten_parameters=False does per layer (each layer's
gathered parameters stay alive to the end of the step), the fixed version
by about as much; its step outputs are only shards, their gradients and the
optimizer state. Each assertion fails on stock torch_xla: run this file with
TORCH_XLA_FSDP_OVERLAY=0 to see it ("fixed" is then stock).

On TPU v5e the fixed version holds at most one unit (the largest flat
parameter gathered) above flatten_parameters=False on the report model, also
with a [32, 4] parameter in each Layer (T5's relative attention bias with 4
heads), and T5 with 4 heads stays within 2.5 (2.2). On A100 it holds at most
one unit above F, and grows like F per layer, with real all-gathers
(pin_layout_in_collective_ops=False; pinned, FSDP's default, torch_xla's
all-gather is an all-reduce of a zero-padded full-size buffer). Before each
gather copied its parameters out as 1-D ranges (they were views of the flat
parameter), the TPU compiler converted the whole gathered unit to bfloat16,
or reshaped it to take out a [32, 4] parameter (padded 32 times by TPU
tiling), and A100 kept each unit gathered for backward alive among its
gradients.

The compiler tests skip, saying what to install, without jax[tpu]==0.10.2 or
jax-cuda12-plugin==0.10.2 and jax-cuda12-pjrt==0.10.2. This repository's
check, not part of the upstream change.
"""

import concurrent.futures
import functools
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import unittest

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)), '..', 'benchmarks'))
import fsdp_compiler_memory as cm  # noqa: E402

LAYERS = (2, 4)
# Measured from 2 to 4 layers, in F's growth per layer: stock T 8.4x on TPU
# v5e, 7.1x on H100; fixed T 1.10x and 0.83x. (Not A100, where the fixed
# version grows 1.48x from 2 to 4 layers and 1.43x from 2 to 8, nor TPU v6e,
# where F keeps more in on-chip memory and grows 8 MB per layer, the fixed
# version 2.0x that from 2 to 8 layers: too close to or above the bound.)
STOCK_MIN_GROWTH = 5.0
FIXED_MAX_GROWTH = 1.5
TPU_TARGET = 'tpu-v5e'
GPU_TARGET = 'gpu-h100'
# where the fixed version keeps the bound with real all-gathers (unpinned),
# growing per layer within 5% of F
UNPINNED_GPU_TARGET = 'gpu-a100'
UNPINNED_MAX_GROWTH = 1.05
WORLD_SIZE = cm.WORLD_SIZE
# one rank's shard of a Layer's flat parameter (13107200 elements, a
# multiple of the world size times 128: no padding)
SHARD_SHAPE = f'f32[{8 * 1280 * 1280 // WORLD_SIZE}]'
_OUT_DIR = None
_TRACER = None
# (model, variant, layers, pin_layout): the future path of its traced step
_TRACES = {}


def setUpModule():
  global _OUT_DIR, _TRACER
  _OUT_DIR = tempfile.mkdtemp(prefix='fsdp_compiler_memory_test_')
  # Traces are made one after the other in the background, so that the
  # next is traced while the compilers work on the last (on 2 cores a
  # fifth of the file's time). Without a compiler only the fixed version's
  # are needed.
  _TRACER = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  variants = ['fixed T']
  if any(cm.missing(t) is None for t in (TPU_TARGET, GPU_TARGET)):
    variants += ['F', 'stock T']
  wanted = [('report', v, n, True) for v in variants for n in LAYERS]
  f_and_fixed = ('F', 'fixed T')
  if cm.missing(UNPINNED_GPU_TARGET) is None:
    wanted += [('report', v, n, False) for v in f_and_fixed for n in LAYERS]
  if cm.missing(TPU_TARGET) is None:
    wanted += [(cm.REPORT_32X4, v, 2, True) for v in f_and_fixed]
  for key in wanted:
    _TRACES[key] = _TRACER.submit(_trace, *key)


def tearDownModule():
  _TRACER.shutdown(cancel_futures=True)
  shutil.rmtree(_OUT_DIR, ignore_errors=True)


def _trace(model, variant, layers, pin_layout=True):
  stock, flatten = cm.VARIANTS[variant]
  return cm.trace(
      True if stock else None,
      flatten,
      layers,
      _OUT_DIR,
      timeout=300,
      model=model,
      pin_layout=pin_layout)


def step_module(variant, layers, pin_layout=True, model='report'):
  """The traced step of ``variant`` ('F', 'stock T' or 'fixed T'); "fixed"
  follows TORCH_XLA_FSDP_OVERLAY (stock with 0). ``pin_layout``: FSDP's
  ``pin_layout_in_collective_ops``. ``model``: 'report' (the default),
  ``cm.REPORT_32X4`` or ``cm.T5_4_HEADS``; a trace that ``setUpModule`` did
  not queue is queued now, behind the others."""
  key = (model, variant, layers, pin_layout)
  if key not in _TRACES:
    _TRACES[key] = _TRACER.submit(_trace, *key)
  return _TRACES[key].result()


# (the compiles are shared by the tests of this file)
@functools.lru_cache(maxsize=None)
def compiled(target, variant, layers, pin_layout=True, model='report'):
  return cm.compile_hlo(step_module(variant, layers, pin_layout, model), target)


def units_above_unflattened(target, model, layers, pin_layout=True):
  """(fixed T - F) / the largest flat parameter the fixed step gathers, of
  ``model`` ('report', ``cm.REPORT_32X4`` or ``cm.T5_4_HEADS``) at
  ``layers`` on ``target``, and a message with the figures."""

  f, fixed = (
      compiled(target, v, layers, pin_layout, model)['total_bytes']
      for v in ('F', 'fixed T'))
  with open(step_module('fixed T', layers, pin_layout, model)) as text:
    unit = cm.largest_gather_bytes(text.read())
  return (fixed - f) / unit, (
      f"{model}, {layers} layers, {target}{'' if pin_layout else ', unpinned'}"
      f': flatten_parameters=False {f / 1e6:.1f} MB, fixed '
      f'flatten_parameters=True {fixed / 1e6:.1f} MB, a unit {unit / 1e6:.1f} '
      'MB')


def output_shapes(hlo_path):
  """The step's outputs (the ENTRY computation's result), layouts dropped."""
  with open(hlo_path) as f:
    header = f.readline()
  m = re.search(r'->\((.*)\)\}', header)
  sig = re.sub(r'\{[\d,]*\}', '', m.group(1) if m else '')
  return re.findall(r'[a-z]\w*\[[\d,]*\]', sig)


def growth_per_layer(target, variant, pin_layout=True):
  lo, hi = min(LAYERS), max(LAYERS)
  return (compiled(target, variant, hi, pin_layout)['total_bytes'] -
          compiled(target, variant, lo, pin_layout)['total_bytes']) / (
              hi - lo)


class OnCompiler:
  """A mixin: the tests compile for ``target`` (named by the subclass), and
  skip without its compiler."""
  target = None

  @classmethod
  def setUpClass(cls):
    why = cm.missing(cls.target)
    if why:
      raise unittest.SkipTest(f'{cls.target}: {why}')


class CompilerMemoryTest(OnCompiler):
  """Per-layer growth of each variant on one compiler (a mixin)."""

  def test_flatten_grows_like_unflattened(self):
    f = growth_per_layer(self.target, 'F')
    stock = growth_per_layer(self.target, 'stock T')
    fixed = growth_per_layer(self.target, 'fixed T')
    growth = (f'{self.target}, per layer: flatten_parameters=False '
              f'{f / 1e6:.1f} MB, stock flatten_parameters=True '
              f'{stock / 1e6:.1f} MB, fixed {fixed / 1e6:.1f} MB')
    # What the fix is for (pytorch/xla#5464): this compiler must show it
    # for the comparison to mean anything.
    self.assertGreater(f, 0, growth)
    self.assertGreaterEqual(stock, STOCK_MIN_GROWTH * f, growth)
    self.assertLessEqual(fixed, FIXED_MAX_GROWTH * f, growth)

  def test_fixed_flatten_outputs_only_shards(self):
    # SGD: each Layer's updated shard and its gradient, as the compiler
    # allocates them
    for layers in LAYERS:
      with self.subTest(layers=layers):
        stats = compiled(self.target, 'fixed T', layers)
        # (besides the shards, the compiler's table of the output tuple)
        self.assertAlmostEqual(
            stats['output_bytes'],
            2 * layers * 8 * 1280 * 1280 // WORLD_SIZE * 4,
            delta=4096)


class TpuCompilerMemoryTest(CompilerMemoryTest, unittest.TestCase):
  target = TPU_TARGET

  def test_fixed_flatten_within_one_unit_of_unflattened(self):
    # Gathered as one flat parameter, a unit costs at most itself above
    # gathering its parameters one by one. (Before: a bfloat16 copy of the
    # whole gathered unit beside it, for dots at default precision: 1.39 and
    # 1.44 units.)
    for layers in LAYERS:
      with self.subTest(layers=layers):
        units, figures = units_above_unflattened(self.target, 'report', layers)
        self.assertLessEqual(units, 1.0, figures)

  def test_parameter_with_four_columns_within_one_unit_of_unflattened(self):
    # The report model with a [32, 4] relative position bias in each Layer,
    # T5's shape. (Before: the TPU compiler reshaped the whole gathered flat
    # parameter to f32[3277056,4] to take the bias out of it, 32 times its
    # size in (8, 128) tiles: 32.3 units above F; stock 99.9.)
    units, figures = units_above_unflattened(self.target, cm.REPORT_32X4, 2)
    self.assertLessEqual(units, 1.0, figures)

  def test_t5_bias_with_four_columns_not_padded_with_its_unit(self):
    if importlib.util.find_spec('transformers') is None:
      self.skipTest('needs transformers: pip install -e ".[models]"')
    units, figures = units_above_unflattened(self.target, cm.T5_4_HEADS, 2)
    # Before: the whole flat parameter of the decoder block reshaped to
    # [N, 4] to take out the [32, 4] relative attention bias, 32 times its
    # size in (8, 128) tiles: 33.0 units above. (Now 2.2: the compiler's
    # heap packs the gathered unit's all-reduce input and output and its
    # copies above what F holds; at its peak 1.1 units are live above F's.)
    self.assertLessEqual(units, 2.5, figures)


class GpuCompilerMemoryTest(CompilerMemoryTest, unittest.TestCase):
  target = GPU_TARGET


class GpuUnpinnedCompilerMemoryTest(OnCompiler, unittest.TestCase):
  """XLA:GPU on A100 with real all-gathers: F and the fixed version with
  ``pin_layout_in_collective_ops=False``. (With the default, pinned, torch_xla
  gathers with an all-reduce of the zero-padded full-size buffer, which
  XLA:GPU also copies into one buffer with torch_xla's ordering token: two
  units at each gather of a flat parameter, where F pays both per
  parameter. A100 is then 0.92 and 1.22 units above F at 2 and 4 layers.)"""
  target = UNPINNED_GPU_TARGET

  def test_fixed_flatten_grows_like_unflattened(self):
    f = growth_per_layer(self.target, 'F', pin_layout=False)
    fixed = growth_per_layer(self.target, 'fixed T', pin_layout=False)
    growth = (f'{self.target}, unpinned, per layer: flatten_parameters=False '
              f'{f / 1e6:.1f} MB, fixed flatten_parameters=True '
              f'{fixed / 1e6:.1f} MB')
    self.assertGreater(f, 0, growth)
    # Before each gather for backward copied its parameters out, they were
    # views of the re-gathered flat parameter, which kept it alive among the
    # unit's gradients: 1.35x F's growth per layer (now 0.99x).
    self.assertLessEqual(fixed, UNPINNED_MAX_GROWTH * f, growth)

  def test_fixed_flatten_within_one_unit_of_unflattened(self):
    # (Before the copies for backward: 0.87 and 1.11 units; now 0.75 and
    # 0.74.)
    for layers in LAYERS:
      with self.subTest(layers=layers):
        units, figures = units_above_unflattened(
            self.target, 'report', layers, pin_layout=False)
        self.assertLessEqual(units, 1.0, figures)


class StepOutputsTest(unittest.TestCase):
  """Needs no compiler: the traced step's outputs."""

  def test_fixed_flatten_outputs_only_shards_and_grads(self):
    for layers in LAYERS:
      with self.subTest(layers=layers):
        shapes = output_shapes(step_module('fixed T', layers))
        # SGD has no state: each Layer's updated shard and its gradient
        self.assertEqual(shapes, [SHARD_SHAPE] * (2 * layers))


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
