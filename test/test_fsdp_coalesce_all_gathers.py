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
import torch_xla
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

import test_utils
from test_fsdp_flatten_features import SameTrainingMixin, train
from test_fsdp_flatten_parity import Block, Net

COALESCED = dict(
    coalesce_all_gather_ops=True, pin_layout_in_collective_ops=False)


class TestCoalescedAllGathers(SameTrainingMixin, test_utils.XlaTestCase):

  def test_same_as_one_all_gather_per_parameter(self):
    for flatten in (False, True):
      with self.subTest(flatten=flatten):
        self.assert_same(
            train('plain', flatten, **COALESCED), train('plain', False))

  def test_unit_without_parameters(self):
    # The root unit has no parameters of its own.
    policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block})
    x = torch.randn(4, 100).to(torch_xla.device())
    for flatten in (False, True):
      grads = {}
      for coalesce in (False, True):
        torch.manual_seed(0)
        model = FSDP(
            nn.Sequential(Block(), Block()),
            auto_wrap_policy=policy,
            flatten_parameters=flatten,
            coalesce_all_gather_ops=coalesce,
            pin_layout_in_collective_ops=False)
        model(x).square().sum().backward()
        torch_xla.sync()
        grads[coalesce] = [p.grad.cpu() for p in model.parameters()]
      with self.subTest(flatten=flatten):
        # a flat parameter per block, or its 4 parameters
        self.assertEqual(len(grads[True]), 2 if flatten else 8)
        for coalesced, separate in zip(grads[True], grads[False]):
          torch.testing.assert_close(coalesced, separate)
          self.assertGreater(coalesced.abs().sum(), 0)

  def test_pinned_layout_rejected(self):
    # xm.all_gather cannot pin the layout of a list of tensors
    with self.assertRaisesRegex(
        ValueError, 'coalesce_all_gather_ops=True needs '
        'pin_layout_in_collective_ops=False'):
      FSDP(Net(), coalesce_all_gather_ops=True)


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
