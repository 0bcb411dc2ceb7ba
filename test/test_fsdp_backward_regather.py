"""An FSDP unit one of whose outputs it also uses itself trains correctly.

T5's first block computes the position bias, uses it in its own attention
and returns it for the blocks after it. The gradient of such an output is
complete only midway through the unit's backward, after the post-backward
hooks of some of its parameters have freed them, and its pre-backward hook
gathers them again. They must not stay gathered, with their values from
before the optimizer step, into the next forward (which does not all-gather
a parameter it holds). Compared with the same model without FSDP over
several SGD steps with ``flatten_parameters=False``, the setting that
trained on stale weights, with and without functionalization
(``XLA_DISABLE_FUNCTIONALIZATION=1``).
"""

import functools
import sys
import unittest

import torch
import torch.nn as nn
import torch_xla
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

import test_utils

STEPS = 4


class Block(nn.Module):
  """``x + b(relu(a(x) + shared))``; the first block computes ``shared``
  from its input and returns it, as T5's first block does its position
  bias."""

  def __init__(self, first):
    super().__init__()
    self.a = nn.Linear(16, 16)
    self.b = nn.Linear(16, 16)
    self.shared = nn.Linear(16, 16) if first else None

  def forward(self, x, shared=None):
    if shared is None:
      shared = self.shared(x)
    return x + self.b(torch.relu(self.a(x) + shared)), shared


class Net(nn.Module):

  def __init__(self):
    super().__init__()
    self.blocks = nn.ModuleList(Block(i == 0) for i in range(3))

  def forward(self, x):
    shared = None
    for block in self.blocks:
      x, shared = block(x, shared)
    return x


def train(flatten_parameters=None):
  """Losses over ``STEPS`` SGD steps, each block an FSDP unit (no FSDP if
  ``flatten_parameters`` is None)."""
  device = torch_xla.device()
  torch.manual_seed(0)
  model = Net()
  if flatten_parameters is None:
    model = model.to(device)
  else:
    model = FSDP(
        model,
        flatten_parameters=flatten_parameters,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}))
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
  x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(device)
  losses = []
  for _ in range(STEPS):
    optimizer.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    losses.append(loss.item())
  return losses


class TestOutputUsedInside(test_utils.XlaTestCase):

  def test_trains_like_without_fsdp(self):
    ref_losses = train()
    # each step's update reaches the next forward
    self.assertLess(ref_losses[1], ref_losses[0])
    torch.testing.assert_close(train(False), ref_losses, rtol=1e-5, atol=0)


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
