"""FSDP units whose parameters are made on the XLA device train like those
built on the CPU.

A ``param_init_fn`` that calls ``module.to_empty(device=...)`` creates the
parameters on the XLA device, as does a module built there; both are then
initialized in place. Training must then update the values that each
forward gathers, for both ``flatten_parameters`` settings, with and without
functionalization (``XLA_DISABLE_FUNCTIONALIZATION=1``): compared over several
SGD-momentum steps with the same model built on the CPU, by losses and by the
consolidated checkpoint.
"""

import itertools
import sys
import unittest
import weakref
from unittest import mock

import torch
import torch.nn as nn
import torch_xla
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
from torch_xla.distributed.fsdp.state_dict_utils import (
    consolidate_sharded_state_dicts)
from torch_xla.distributed.fsdp.wrap import always_wrap_policy

import test_utils

STEPS = 3


class Linear(nn.Linear):
  """A ``Linear`` with a deterministic ``reset_parameters``."""

  def reset_parameters(self):
    with torch.no_grad():
      self.weight.copy_(
          torch.linspace(-1, 1, self.weight.numel()).view_as(self.weight))
      if self.bias is not None:
        self.bias.copy_(torch.linspace(-0.5, 0.5, self.bias.numel()))


class Net(nn.Module):

  def __init__(self, device=None):
    super().__init__()
    self.fc1 = Linear(6, 10, bias=False, device=device)
    self.fc2 = Linear(10, 6, device=device)

  def forward(self, x):
    return self.fc2(torch.tanh(self.fc1(x)))

  def reset_parameters(self):
    for m in self.children():
      if not isinstance(m, FSDP):
        m.reset_parameters()


def init_with_reset_parameters(module):
  # As upstream's test/torch_distributed/test_torch_distributed_fsdp_meta.py.
  if any(p.is_meta for p in module.parameters()):
    module.to_empty(device=torch_xla.device())
  with torch.no_grad():
    module.reset_parameters()


def train(flatten_parameters, init, auto_wrap):
  """Losses and the consolidated checkpoint after ``STEPS`` steps of the
  model built on the meta device, on the XLA device or on the CPU (``init``)
  and initialized by ``reset_parameters()``."""
  kwargs = dict(flatten_parameters=flatten_parameters)
  if auto_wrap:
    kwargs['auto_wrap_policy'] = always_wrap_policy
  if init == 'meta':
    model = FSDP(
        Net(device='meta'), param_init_fn=init_with_reset_parameters, **kwargs)
  else:
    net = Net(device=torch_xla.device() if init == 'xla' else None)
    net.reset_parameters()
    model = FSDP(net, **kwargs)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
  device = torch_xla.device()
  generator = torch.Generator().manual_seed(0)
  losses = []
  for _ in range(STEPS):
    x = torch.randn(10, 6, generator=generator).to(device)
    optimizer.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    losses.append(loss.item())
  state_dict = {k: v.cpu() for k, v in model.state_dict().items()}
  checkpoint = consolidate_sharded_state_dicts([state_dict],
                                               model.get_shard_metadata())
  return losses, checkpoint


class TestMetaInit(test_utils.XlaTestCase):

  def test_trains_like_eager_init(self):
    for flatten_parameters, auto_wrap, init in itertools.product(
        (False, True), (False, True), ('meta', 'xla')):
      with self.subTest(
          flatten_parameters=flatten_parameters, auto_wrap=auto_wrap,
          init=init):
        losses, checkpoint = train(flatten_parameters, init, auto_wrap)
        ref_losses, ref_checkpoint = train(flatten_parameters, 'cpu', auto_wrap)
        # The model trains: each step's update reaches the next forward.
        self.assertLess(ref_losses[-1], ref_losses[0])
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
        self.assertEqual(sorted(checkpoint), sorted(ref_checkpoint))
        for name in ref_checkpoint:
          self.assertFalse(checkpoint[name].is_meta, name)
          torch.testing.assert_close(
              checkpoint[name],
              ref_checkpoint[name],
              rtol=1e-6,
              atol=1e-7,
              msg=lambda m: f'{name}: {m}')

  def test_init_sync_does_not_keep_the_original_parameters(self):
    # execute_sharding_on_init syncs to free the full parameters. A parameter
    # made on the XLA device is sharded and freed as a copy; the original,
    # which holds the full data, must be unreferenced by then, or the sync
    # keeps its data as an output.
    net = Net(device=torch_xla.device())
    net.reset_parameters()
    originals = [weakref.ref(p) for p in net.parameters()]
    alive_at_sync = []
    sync = torch_xla.sync

    def record_and_sync(*args, **kwargs):
      alive_at_sync.extend(r() for r in originals if r() is not None)
      return sync(*args, **kwargs)

    with mock.patch.object(
        torch_xla, 'sync', side_effect=record_and_sync) as mocked:
      model = FSDP(net, flatten_parameters=False)
    mocked.assert_called()
    # (without functionalization, FSDP frees the originals themselves)
    freed_by_fsdp = [
        p for p in alive_at_sync if any(p is q for q in model.full_params)
    ]
    self.assertEqual(len(freed_by_fsdp), len(alive_at_sync))


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
