"""XlaFullyShardedDataParallel(coalesce_all_gather_ops=True).

One all-gather of a list of shards per unit. Before this was fixed, inner
units auto-wrapped by the root did not inherit the option, a unit gathered
nothing unless its shards had ``_shard_size_multiple=1`` (and
``xm.all_gather`` of the empty list then failed), and the gathered
parameters were shaped as if sharded on dim 0. Trained models must equal
those trained with one all-gather per parameter.
"""

import functools
import sys
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

import test_utils


class Block(nn.Module):

  def __init__(self, dim=20, hidden=30):
    super().__init__()
    self.fc1 = nn.Linear(dim, hidden)
    self.fc2 = nn.Linear(hidden, dim)

  def forward(self, x):
    return x + self.fc2(F.relu(self.fc1(x)))


def train(root_params, steps=3, **fsdp_kwargs):
  """Losses and final parameters of two auto-wrapped blocks under a root
  with (a head) or without parameters of its own, and the inputs of its
  all-gathers: a list of shards, or one shard."""
  torch.manual_seed(0)
  layers = [Block(), Block()] + ([nn.Linear(20, 5)] if root_params else [])
  model = FSDP(
      nn.Sequential(*layers),
      auto_wrap_policy=functools.partial(
          transformer_auto_wrap_policy, transformer_layer_cls={Block}),
      pin_layout_in_collective_ops=False,
      **fsdp_kwargs)
  gathered = []
  for unit in model.modules():
    if isinstance(unit, FSDP):
      unit.all_gather_op = functools.partial(record_input, gathered,
                                             unit.all_gather_op)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
  x = torch.randn(8, 20).to(torch_xla.device())
  losses = []
  for _ in range(steps):
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    losses.append(loss.item())
  return losses, [p.detach().cpu() for p in model.parameters()], gathered


def record_input(gathered, all_gather_op, input, **kwargs):
  gathered.append(
      len(input) if isinstance(input, list) else type(input).__name__)
  return all_gather_op(input, **kwargs)


class TestCoalescedAllGathers(test_utils.XlaTestCase):

  def test_same_as_one_all_gather_per_parameter(self):
    for sharding in (dict(flatten_parameters=False),
                     dict(flatten_parameters=True),
                     dict(flatten_parameters=False, shard_param_on_dim_0=True)):
      for root_params in (False, True):
        with self.subTest(**sharding, root_params=root_params):
          losses, params, gathered = train(
              root_params, coalesce_all_gather_ops=True, **sharding)
          expected_losses, expected_params, _ = train(root_params, **sharding)
          # One all-gather of a list per unit and gather: the blocks' (their
          # 1 flat or 4 parameters each) in forward and again in backward,
          # the root's only in forward (it is not resharded after it).
          flat = sharding['flatten_parameters']
          root = [1 if flat else 2] if root_params else []
          self.assertCountEqual(gathered, (root + [1 if flat else 4] * 4) * 3)
          self.assertEqual(losses, expected_losses)
          # it trains: the loss went down
          self.assertLess(losses[-1], losses[0])
          self.assertEqual(len(params), len(expected_params))
          for p, expected in zip(params, expected_params):
            torch.testing.assert_close(p, expected, rtol=0, atol=0)

  def test_pinned_layout_rejected(self):
    # xm.all_gather cannot pin the layout of a list of tensors
    with self.assertRaisesRegex(
        ValueError, 'coalesce_all_gather_ops=True needs '
        'pin_layout_in_collective_ops=False'):
      FSDP(Block(), coalesce_all_gather_ops=True)


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
