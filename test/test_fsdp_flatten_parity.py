"""flatten_parameters=True trains like flatten_parameters=False.

Compared over several AdamW steps, to float32 rounding (more on backends
whose compilers may fuse the two graphs differently): losses, gradient
norms (``clip_grad_norm_``) and the consolidated checkpoint
(``consolidate_sharded_state_dicts``). The model nests one FSDP unit per
block inside a root unit with parameters of its own, and its flat parameters
need padding.
"""

import functools
import sys
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
from torch_xla.distributed.fsdp.state_dict_utils import (
    consolidate_sharded_state_dicts)
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

import test_utils
from fsdp_test_utils import count_collectives

STEPS = 4
RTOL = 1e-6 if xr.device_type() == 'CPU' else 1e-4


class Block(nn.Module):

  def __init__(self, dim=100, hidden=300):
    super().__init__()
    self.fc1 = nn.Linear(dim, hidden)
    self.fc2 = nn.Linear(hidden, dim)

  def forward(self, x):
    return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):

  def __init__(self, num_blocks=3, dim=100, classes=10):
    super().__init__()
    self.blocks = nn.ModuleList([Block(dim) for _ in range(num_blocks)])
    self.head = nn.Linear(dim, classes)

  def forward(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def wrapped_net(flatten_parameters):
  """``Net`` with each block an FSDP unit under the root."""
  torch.manual_seed(0)
  policy = functools.partial(
      transformer_auto_wrap_policy, transformer_layer_cls={Block})
  return FSDP(
      Net(), auto_wrap_policy=policy, flatten_parameters=flatten_parameters)


def train(flatten_parameters, steps=STEPS):
  """Losses, gradient norms, the last step's collectives, final checkpoint."""
  model = wrapped_net(flatten_parameters)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
  device = torch_xla.device()
  generator = torch.Generator().manual_seed(1)
  x = torch.randn(32, 100, generator=generator).to(device)
  y = torch.randint(0, 10, (32,), generator=generator).to(device)
  losses, grad_norms = [], []
  for _ in range(steps):
    optimizer.zero_grad()
    with count_collectives(model) as collectives:
      loss = F.cross_entropy(model(x), y)
      loss.backward()
    grad_norm = model.clip_grad_norm_(1e9)  # reports the norm, clips nothing
    optimizer.step()
    torch_xla.sync()
    losses.append(loss.item())
    grad_norms.append(grad_norm.item())
  state_dict = {k: v.cpu() for k, v in model.state_dict().items()}
  full = consolidate_sharded_state_dicts([state_dict],
                                         model.get_shard_metadata())
  return {
      'losses': losses,
      'grad_norms': grad_norms,
      'collectives': collectives,
      'checkpoint': full
  }


def step_graph_outputs(model):
  """The number of outputs of a training step's graph (the device data it
  creates) beyond ``model``'s parameters (their shards) and gradients. SGD
  keeps no state."""
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
  x = torch.randn(32, 100).to(torch_xla.device())
  for _ in range(2):  # (the second step's)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()
    created = met.counter_value('CreateDataHandles') or 0
    torch_xla.sync()
    xm.wait_device_ops()  # (the count is complete once the graph has run)
    outputs = met.counter_value('CreateDataHandles') - created
  return outputs - 2 * len(list(model.parameters()))


class TestFlattenParity(test_utils.XlaTestCase):

  @classmethod
  def setUpClass(cls):
    cls.unflat = train(False)
    cls.flat = train(True)

  def assert_same_training(self, a, b):
    torch.testing.assert_close(a['losses'], b['losses'], rtol=RTOL, atol=0)
    torch.testing.assert_close(
        a['grad_norms'], b['grad_norms'], rtol=RTOL, atol=0)
    self.assertEqual(a['collectives'], b['collectives'])
    self.assertEqual(sorted(a['checkpoint']), sorted(b['checkpoint']))
    for name in a['checkpoint']:
      torch.testing.assert_close(
          a['checkpoint'][name],
          b['checkpoint'][name],
          rtol=RTOL,
          atol=1e-7,
          msg=lambda m: f'{name}: {m}')

  def test_same_as_unflattened(self):
    # (the comparison means something only if both train)
    losses = self.unflat['losses']
    self.assertTrue(all(a > b for a, b in zip(losses, losses[1:])), losses)
    flat = dict(self.flat, collectives=None)
    self.assert_same_training(flat, dict(self.unflat, collectives=None))

  def test_step_graph_outputs_only_shards_and_gradients(self):
    # Issue #5464: the original parameters were views into the gathered flat
    # parameter, which the submodules and autograd kept alive after forward,
    # so every unit's gathered parameters were also outputs of the step
    # graph. Beyond the parameters (their shards) and their gradients, the
    # graph must output what it does with flatten_parameters=False.
    self.assertEqual(
        step_graph_outputs(wrapped_net(True)),
        step_graph_outputs(wrapped_net(False)))

  def test_one_all_gather_and_reduce_scatter_per_flat_param(self):
    # 4 units (3 blocks, root): each gathered for forward and, except the
    # root (not resharded after forward), again for backward.
    self.assertEqual(self.flat['collectives'], {
        'all_gather': 4 + 3,
        'reduce_scatter': 4
    })


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
