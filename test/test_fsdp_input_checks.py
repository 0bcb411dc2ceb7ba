"""Input XlaFullyShardedDataParallel cannot shard.

A parameter that is not float32 used to fail in flattening or sharding with
an error that names no parameter; it still fails there, with an error that
names it.
"""

import functools
import sys
import unittest

import torch
import torch.nn as nn
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

import test_utils


class Block(nn.Module):

  def __init__(self, dim=8):
    super().__init__()
    self.fc1 = nn.Linear(dim, dim)
    self.fc2 = nn.Linear(dim, dim)

  def forward(self, x):
    return self.fc2(self.fc1(x))


class Net(nn.Module):

  def __init__(self, num_blocks=2, dim=8):
    super().__init__()
    self.blocks = nn.ModuleList([Block(dim) for _ in range(num_blocks)])
    self.head = nn.Linear(dim, 2)

  def forward(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


class TestBadInput(test_utils.XlaTestCase):
  """Clear errors, where sharding used to fail without naming anything."""

  def assert_rejected(self, net, message, **kwargs):
    policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block})
    with self.assertRaisesRegex(TypeError, message):
      FSDP(net, auto_wrap_policy=policy, **kwargs)

  def test_not_float32(self):
    for flatten in (False, True):
      with self.subTest(flatten=flatten):
        self.assert_rejected(
            Net().to(torch.bfloat16),
            r"float32 .* 'fc1\.weight' of Block is torch\.bfloat16",
            flatten_parameters=flatten)

  def test_mixed_dtypes_in_one_flat_parameter(self):
    net = Net()
    net.blocks[1].fc2.bias.data = net.blocks[1].fc2.bias.data.half()
    self.assert_rejected(
        net,
        r"'fc2\.bias' of Block is torch\.float16 \(a flat parameter",
        flatten_parameters=True)

  def test_not_float32_beside_a_unit_made_before(self):
    net = Net()
    net.blocks[0] = FSDP(net.blocks[0])
    net.head.to(torch.float16)
    with self.assertRaisesRegex(TypeError,
                                r"'head\.weight' of Net is torch\.float16"):
      FSDP(net)

  def test_unit_made_before_and_cast_after(self):
    # (its shards are checked too: without the check the first step failed
    # on a shape, naming nothing)
    net = Net()
    net.blocks[0] = FSDP(net.blocks[0]).half()
    with self.assertRaisesRegex(TypeError, r"of Net is torch\.float16"):
      FSDP(net)


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
