"""flatten_parameters=True with the other FSDP features.

Each feature trains the same nested model (test_fsdp_flatten_parity.Net) for
a few steps with flatten_parameters=True and is compared with
flatten_parameters=False: losses and the consolidated checkpoint must be
identical. Where stock flatten_parameters=False itself differs (bfloat16
compute) or fails (coalesced all-gathers without shard_param_on_dim_0), the
reference is stock flatten_parameters=True (child process, overlay off) or
the plain flattened run.
"""

import functools
import os
import subprocess
import sys
import tempfile
import unittest

import fsdp_memory_utils as mu  # noqa: F401  (first: it sets XLA_FLAGS)
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
from torch_xla.distributed.fsdp import (XlaFullyShardedDataParallel as FSDP,
                                        checkpoint_module)
from torch_xla.distributed.fsdp.state_dict_utils import (
    consolidate_sharded_state_dicts)
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

from test_fsdp_flatten_parity import Block, Net

STEPS = 3


def build(feature, flatten_parameters):
  torch.manual_seed(0)
  net = Net()
  kwargs = {}
  if feature == 'checkpoint':
    kwargs['auto_wrapper_callable'] = (
        lambda m, *args, **kw: FSDP(checkpoint_module(m), *args, **kw))
  elif feature == 'bf16':
    kwargs['compute_dtype'] = torch.bfloat16
  elif feature == 'bf16_fp32_reduce_scatter':
    kwargs.update(compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
  elif feature == 'no_reshard':
    kwargs['reshard_after_forward'] = False
  elif feature == 'coalesce':
    kwargs.update(
        coalesce_all_gather_ops=True,
        pin_layout_in_collective_ops=False,
        _shard_size_multiple=1)
  elif feature == 'frozen':
    net.blocks[1].fc1.requires_grad_(False)
  elif feature == 'batchnorm':
    # ops whose size checks read a tensor's creation-time metadata
    for block in net.blocks:
      block.fc1 = nn.Sequential(block.fc1, nn.BatchNorm1d(300))
  elif feature == 'tied':
    # a parameter used twice, and a submodule under two names, in one unit
    net.blocks[0].fc2.weight = nn.Parameter(
        net.blocks[0].fc1.weight.detach().t().clone())
    for block in net.blocks:
      block.fc3 = block.fc1
  policy = functools.partial(
      transformer_auto_wrap_policy, transformer_layer_cls={Block})
  return FSDP(
      net,
      auto_wrap_policy=policy,
      flatten_parameters=flatten_parameters,
      **kwargs)


def train(feature, flatten_parameters, steps=STEPS):
  model = build(feature, flatten_parameters)
  optimizer = torch.optim.SGD(
      [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
  device = torch_xla.device()
  generator = torch.Generator().manual_seed(1)
  x = torch.randn(32, 100, generator=generator).to(device)
  y = torch.randint(0, 10, (32,), generator=generator).to(device)
  losses = []
  for _ in range(steps):
    optimizer.zero_grad()
    if feature == 'no_sync':  # gradient accumulation over two micro-batches
      with model.no_sync():
        F.cross_entropy(model(x[:16]), y[:16]).backward()
      loss = F.cross_entropy(model(x[16:]), y[16:])
    elif feature == 'two_forwards':
      loss = (
          F.cross_entropy(model(x[:16]), y[:16]) +
          F.cross_entropy(model(x[16:]), y[16:]))
    else:
      if feature == 'eval_first':
        model.eval()
        with torch.no_grad():
          model(x)
        model.train()
      loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    losses.append(loss.item())
  state_dict = {k: v.cpu() for k, v in model.state_dict().items()}
  return {
      'losses':
          losses,
      'checkpoint':
          consolidate_sharded_state_dicts([state_dict],
                                          model.get_shard_metadata()),
  }


def train_stock(feature):
  """``train(feature, True)`` with stock torch_xla's FSDP."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'stock.pt')
    subprocess.run(
        [sys.executable,
         os.path.abspath(__file__), '--save', feature, path],
        env=dict(os.environ, TORCH_XLA_FSDP_OVERLAY='0'),
        check=True,
        capture_output=True)
    return torch.load(path)


class TestFlattenFeatures(unittest.TestCase):

  def assert_same(self, a, b, rtol=0.0):
    torch.testing.assert_close(a['losses'], b['losses'], rtol=rtol, atol=0)
    self.assertEqual(a['checkpoint'].keys(), b['checkpoint'].keys())
    for name, value in a['checkpoint'].items():
      torch.testing.assert_close(
          value,
          b['checkpoint'][name],
          rtol=rtol,
          atol=rtol * 1e-1,
          msg=lambda m: f'{name}: {m}')

  def test_same_as_unflattened(self):
    for feature in ('checkpoint', 'no_sync', 'no_reshard', 'two_forwards',
                    'eval_first', 'frozen', 'tied'):
      with self.subTest(feature=feature):
        self.assert_same(train(feature, True), train(feature, False))

  def test_batchnorm_same_as_unflattened(self):
    # Not bit for bit: the graphs differ (barriers, slices), and XLA may
    # order BatchNorm's reductions differently (2 float32 ulps on a loss).
    self.assert_same(
        train('batchnorm', True), train('batchnorm', False), rtol=1e-6)

  def test_coalesced_all_gather_same_as_plain(self):
    # (stock flatten_parameters=False cannot coalesce unless sharding on dim 0)
    self.assert_same(train('coalesce', True), train('plain', True))

  @unittest.skipUnless(
      any(type(f).__name__ == 'FsdpOverlayFinder' for f in sys.meta_path),
      'needs this change installed as an overlay over a stock torch_xla')
  def test_bfloat16_same_as_stock_flattened(self):
    for feature in ('bf16', 'bf16_fp32_reduce_scatter'):
      with self.subTest(feature=feature):
        self.assert_same(train(feature, True), train_stock(feature))

  def test_eval_and_no_grad_forwards_free(self):
    model = build('plain', True)
    x = torch.randn(4, 100, device=torch_xla.device())
    for mode in ('eval', 'no_grad'):
      with self.subTest(mode=mode):
        model.train(mode != 'eval')
        with torch.no_grad() if mode == 'no_grad' else torch.enable_grad():
          model(x)
        for m in model.modules():
          if isinstance(m, nn.Linear) and m is not model.head:
            self.assertFalse(m.weight._is_view())
            # (shape follows the swapped data; numel keeps the creation size)
            self.assertEqual(tuple(m.weight.shape), (1,))


if __name__ == '__main__':
  if '--save' in sys.argv:
    i = sys.argv.index('--save')
    torch.save(train(sys.argv[i + 1], True), sys.argv[i + 2])
    sys.exit(0)
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
