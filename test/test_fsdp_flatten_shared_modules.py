"""A submodule of a flattened unit called outside the unit's forward.

With flatten_parameters=True, a unit's original parameters hold data only
in its forward and backward. A submodule called while they are freed, by
another FSDP unit of the model (which shares it, or reaches it through the
unit's attributes), gathers them: in the model's first forward, and the
unit keeps them gathered after forward from then on, as with
``reshard_after_forward=False``. Elsewhere the call raises an error rather
than issue an all-gather that not every rank may issue. Run with and
without functionalization (``XLA_DISABLE_FUNCTIONALIZATION=1``).
"""

import sys
import unittest

import torch
import torch_xla

import test_utils
from fsdp_test_utils import count_collectives
from test_fsdp_flatten_freed_params import (make_batch, make_net, train_losses,
                                            wrap)
from test_fsdp_flatten_parity import Net


class SharedWithRoot(Net):
  """The root's head is also a submodule of the second block's unit."""

  def __init__(self):
    super().__init__()
    self.blocks[1].head = self.head


class WrappedTwice(Net):
  """The first block is also the last: FSDP wraps it once, and its second
  use calls its submodules outside its unit."""

  def __init__(self):
    super().__init__()
    self.blocks.append(self.blocks[0])


class CallsBeforeOwner(Net):
  """The root calls a submodule of the last block before that block's unit
  has run."""

  def __init__(self):
    super().__init__()
    self.pre = self.blocks[-1].fc1

  def forward(self, x):
    return super().forward(x + self.pre(x)[:, :x.shape[1]])


class CallsThroughUnit(Net):
  """The root also calls a submodule of the first block through that
  block's attributes (its unit's, once wrapped)."""

  def forward(self, x):
    return super().forward(x) + self.blocks[0].fc2(
        self.blocks[0].fc1(x))[:, :10]


class CallsLater(Net):
  """The root calls a submodule of the first block once ``call`` is set."""

  call = False

  def forward(self, x):
    out = super().forward(x)
    return out + self.blocks[0].fc1(x)[:, :10] if self.call else out


class Fails(Net):
  """The second block raises while ``fail`` is set."""

  fail = False

  def __init__(self):
    super().__init__()
    self.blocks[1].register_forward_pre_hook(self.maybe_fail)

  def maybe_fail(self, module, args):
    if self.fail:
      raise ValueError('a forward that fails')


def train_without_fsdp(cls, steps=2):
  net = make_net(cls).to(torch_xla.device())
  return train_losses(net, steps)


class TestCalledByAnotherUnit(test_utils.XlaTestCase):

  def test_trains_as_without_fsdp(self):
    # (on the previous patch: an error naming the freed parameter; stock:
    # views of the flat parameter kept the data gathered for forward)
    for cls in (SharedWithRoot, WrappedTwice, CallsBeforeOwner,
                CallsThroughUnit):
      with self.subTest(model=cls.__name__):
        with self.assertWarnsRegex(UserWarning,
                                   'keeps them gathered after forward'):
          losses = train_losses(wrap(make_net(cls)), steps=2)
        torch.testing.assert_close(
            losses, train_without_fsdp(cls), rtol=1e-5, atol=0)

  def test_after_the_first_forward_raises(self):
    # Whether a unit keeps its parameters gathered after forward is decided
    # by the model's first forward, not switched for good by a later call.
    model = wrap(make_net(CallsLater))
    x, _ = make_batch()
    with torch.no_grad():
      model(x)
      CallsLater.call = True
      try:
        with self.assertRaisesRegex(
            RuntimeError, r"Module 'blocks\.0\.fc1' .* not in the model's "
            "first forward"):
          model(x)
      finally:
        CallsLater.call = False
    self.assertTrue(model.blocks[0].reshard_after_forward)


class TestCalledOutsideEveryForward(test_utils.XlaTestCase):

  def assert_raises_without_collectives(self, model, call):
    with count_collectives(model) as collectives, self.assertRaisesRegex(
        RuntimeError,
        r"Module 'blocks\.0\.fc1' is called outside every FSDP forward"):
      call()
    self.assertEqual(collectives['all_gather'], 0)
    self.assertTrue(model.blocks[0].reshard_after_forward)

  def test_probe_between_steps_raises(self):
    # A probe between steps, maybe on some ranks only: gathering there would
    # be an all-gather from that call site.
    model = wrap(make_net())
    x, _ = make_batch()
    with torch.no_grad():
      model(x)
      self.assert_raises_without_collectives(model,
                                             lambda: model.blocks[0].fc1(x))

  def test_probe_after_a_failed_forward_raises(self):
    # A forward that raised is over: a call after it is outside it.
    model = wrap(make_net(Fails))
    x, _ = make_batch()
    Fails.fail = True
    try:
      with self.assertRaisesRegex(ValueError, 'a forward that fails'):
        model(x)
    finally:
      Fails.fail = False
    with torch.no_grad():
      self.assert_raises_without_collectives(model,
                                             lambda: model.blocks[0].fc1(x))


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
