"""Bucketed reduce-scatters (reduce_scatter_bucket_size_mb > 0) train like
unbucketed ones: every bucket is flushed by the end of backward."""

import sys
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.runtime as xr
from torch_xla.distributed.fsdp import (XlaFullyShardedDataParallel as FSDP,
                                        checkpoint_module)

import test_utils

RTOL = 1e-6 if xr.device_type() == 'CPU' else 1e-4


class Block(nn.Module):
  """Two checkpointed submodules: in backward, the block's flat parameter
  gets its gradient in two parts, one per recompute."""

  def __init__(self, dim=100, hidden=300):
    super().__init__()
    self.fc1 = checkpoint_module(nn.Linear(dim, hidden))
    self.fc2 = checkpoint_module(nn.Linear(hidden, dim))

  def forward(self, x):
    return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):

  def __init__(self, wrap):
    super().__init__()
    self.blocks = nn.ModuleList([wrap(Block()) for _ in range(2)])
    self.head = nn.Linear(100, 10)

  def forward(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def train(bucket_size_mb, steps=3):
  torch.manual_seed(0)
  kwargs = dict(
      flatten_parameters=True,
      reduce_scatter_bucket_size_mb=bucket_size_mb,
      # (a reduce-scatter of several tensors does not pin layouts)
      pin_layout_in_collective_ops=False)
  model = FSDP(Net(lambda m: FSDP(m, **kwargs)), **kwargs)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
  device = torch_xla.device()
  generator = torch.Generator().manual_seed(1)
  x = torch.randn(32, 100, generator=generator).to(device)
  y = torch.randint(0, 10, (32,), generator=generator).to(device)
  losses = []
  for _ in range(steps):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    losses.append(loss.item())
  return losses


class TestBucketedReduceScatter(test_utils.XlaTestCase):

  def test_gradient_in_parts_same_as_unbucketed(self):
    # Each part of a gradient runs the post-backward hook, which flushed the
    # bucket only when its count of hooks to call reached zero: the part
    # after it stayed in the bucket until the next backward.
    torch.testing.assert_close(train(100), train(0), rtol=RTOL, atol=0)


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
