"""flatten_parameters=True frees a unit's original parameters with it.

Issue #5464: the original parameters were views into the gathered flat
parameter, which the submodules and autograd kept, with the data gathered
for forward, until backward. Now, like unflattened parameters, they hold
data only while their unit has its flat parameter gathered; a use of one
outside that time raises an error that names it. Each test names what stock
did. Run with and without functionalization
(``XLA_DISABLE_FUNCTIONALIZATION=1``).
"""

import copy
import functools
import re
import sys
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
from torch_xla.distributed.fsdp import (XlaFullyShardedDataParallel as FSDP,
                                        checkpoint_module)
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

import test_utils
from fsdp_test_utils import count_collectives, torch_checkpoint
from test_fsdp_flatten_parity import Block, Net, RTOL, step_graph_outputs


class TorchCheckpointBlock(Block):
  """Checkpoints its two layers with ``torch.utils.checkpoint``: two
  recomputes in its unit's backward."""

  def __init__(self, use_reentrant):
    super().__init__()
    self.use_reentrant = use_reentrant

  def forward(self, x):
    if not x.requires_grad:  # (as checkpoint_module)
      return super().forward(x)
    h = torch_checkpoint(
        lambda x: F.relu(self.fc1(x)), x, use_reentrant=self.use_reentrant)
    return x + torch_checkpoint(self.fc2, h, use_reentrant=self.use_reentrant)


class ReadsWeight(Net):
  """The root reads a parameter of the first block by attribute."""

  def forward(self, x):
    return super().forward(x) + F.linear(x, self.blocks[0].fc1.weight)[:, :10]


class SharedWithRoot(Net):
  """The root's head is also a submodule of the second block's unit, which
  flattens its parameters."""

  def __init__(self):
    super().__init__()
    self.blocks[1].head = self.head


class UsedTwice(Net):
  """The first block is used twice: its unit gets two pre-backward hooks."""

  def forward(self, x):
    return self.head(self.blocks[0](self.blocks[1](self.blocks[0](x))))


class TwoOutputBlock(Block):

  def forward(self, x):
    h = F.relu(self.fc1(x))
    return x + self.fc2(h), h.mean(-1, keepdim=True)


class TwoOutputs(Net):
  """The first block's unit has two outputs: two pre-backward hooks."""

  def __init__(self):
    super().__init__()
    self.blocks[0] = TwoOutputBlock()

  def forward(self, x):
    x, s = self.blocks[0](x)
    for block in self.blocks[1:]:
      x = block(x)
    return self.head(x * s)


class Regularized(Net):
  """The root adds a function of a parameter of the first block."""

  def forward(self, x):
    return super().forward(x) + self.blocks[0].fc2.weight.pow(2).sum()


def make_net(cls=Net, inner_checkpoint=None):
  """``cls()``; each block's two layers checkpointed with
  ``inner_checkpoint``: 'checkpoint_module', or 'reentrant' or
  'non_reentrant' ``torch.utils.checkpoint``."""
  torch.manual_seed(0)
  net = cls()
  for i, block in enumerate(net.blocks):
    if inner_checkpoint == 'checkpoint_module':
      block.fc1 = checkpoint_module(block.fc1)
      block.fc2 = checkpoint_module(block.fc2)
    elif inner_checkpoint is not None:
      net.blocks[i] = TorchCheckpointBlock(inner_checkpoint == 'reentrant')
      net.blocks[i].load_state_dict(block.state_dict())
  return net


def wrap(net, flatten_parameters=True, **kwargs):
  """``net`` with each block an FSDP unit under the root."""
  policy = functools.partial(
      transformer_auto_wrap_policy, transformer_layer_cls={Block})
  return FSDP(
      net,
      auto_wrap_policy=policy,
      flatten_parameters=flatten_parameters,
      **kwargs)


def make_batch():
  device = torch_xla.device()
  generator = torch.Generator().manual_seed(1)
  return (torch.randn(32, 100, generator=generator).to(device),
          torch.randint(0, 10, (32,), generator=generator).to(device))


def train_losses(model, steps=3):
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  x, y = make_batch()
  losses = []
  for _ in range(steps):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    losses.append(loss.item())
  return losses


def block_linears(model):
  """The blocks' layers (the root keeps its own parameters gathered from
  forward to backward)."""
  return [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]


class TestFreedWithTheFlatParameter(test_utils.XlaTestCase):

  def assert_trains_as_without_fsdp(self, net, wrap_net):
    """``wrap_net(net)`` trains to the losses of ``net`` without FSDP."""
    reference = copy.deepcopy(net).to(torch_xla.device())
    torch.testing.assert_close(
        train_losses(wrap_net(net)), train_losses(reference), rtol=1e-5, atol=0)

  def assert_freed(self, model):
    for linear in block_linears(model):
      # (stock: a view of the flat parameter, which pins the data gathered
      # for forward)
      self.assertNotIsInstance(linear.weight, torch.Tensor)

  def test_freed_after_forward(self):
    model = wrap(make_net())
    x, _ = make_batch()
    model(x)
    self.assert_freed(model)

  def test_freed_after_backward(self):
    model = wrap(make_net())
    x, y = make_batch()
    F.cross_entropy(model(x), y).backward()
    self.assert_freed(model)

  def test_freed_after_forward_without_grad(self):
    model = wrap(make_net())
    x, _ = make_batch()
    for mode in ('eval', 'no_grad'):
      with self.subTest(mode=mode):
        model.train(mode != 'eval')
        with torch.no_grad() if mode == 'no_grad' else torch.enable_grad():
          model(x)
        self.assert_freed(model)

  def test_unit_with_two_outputs_freed_after_backward(self):
    # Its second pre-backward hook finds its parameters gathered. (stock: the
    # views kept the gathered data, an output of the step; so did a version
    # that lost track there of the tensors holding it)
    self.assertEqual(
        step_graph_outputs(wrap(make_net(TwoOutputs))),
        step_graph_outputs(
            wrap(make_net(TwoOutputs), flatten_parameters=False)))

  def test_checkpointed_inside_trains_as_unflattened(self):
    for style in ('checkpoint_module', 'reentrant', 'non_reentrant'):
      with self.subTest(style=style):
        torch.testing.assert_close(
            train_losses(wrap(make_net(inner_checkpoint=style))),
            train_losses(wrap(make_net(inner_checkpoint=style), False)),
            rtol=RTOL,
            atol=0)

  def test_checkpointed_as_a_whole_and_inside_trains_as_without_fsdp(self):
    # Each block unit is recomputed by a checkpoint around it, and its layers
    # again by their own checkpoints inside that recompute.
    def make():
      return make_net(inner_checkpoint='checkpoint_module')

    model = wrap(
        make(),
        auto_wrapper_callable=lambda m, *args, **kwargs: checkpoint_module(
            FSDP(m, *args, **kwargs)))
    torch.testing.assert_close(
        train_losses(model),
        train_losses(make().to(torch_xla.device())),
        rtol=1e-5,
        atol=0)

  def test_parameter_read_directly_in_two_checkpoints_trains(self):
    # Two reentrant checkpoints read a parameter of the unit directly, not
    # through a submodule: the second recompute reads it after the first
    # part of the gradient has come.
    class TwiceScaled(Net):

      def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((100,), 1.1))

      def forward(self, x):
        for _ in range(2):
          x = torch_checkpoint(
              lambda t: t * self.scale, x.requires_grad_(), use_reentrant=True)
        return super().forward(x)

    torch.manual_seed(0)
    net = TwiceScaled()
    self.assert_trains_as_without_fsdp(
        net, lambda net: FSDP(net, flatten_parameters=True))

  def test_unit_called_by_another_unit_trains_as_without_fsdp(self):
    # A unit's forward calls a unit that is not its submodule. The caller's
    # checkpointed layer gives part of its gradient before the callee's
    # backward, the rest after it. (Stock trains this: its views keep the
    # data. A free as the callee's backward starts broadcast a placeholder
    # into a wrong gradient: the free waits for the end of backward.)
    class Caller(nn.Module):

      def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 100))
        self.fc = checkpoint_module(nn.Linear(100, 100))

      def forward(self, x, callee):
        return self.fc(x * self.scale + callee(x))

    class CallerNet(Net):

      def __init__(self):
        super().__init__()
        self.pre, self.caller = nn.Linear(100, 100), Caller()

      def forward(self, x):
        return self.head(self.caller(self.pre(x), self.blocks[0]))

    policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block, Caller})
    torch.manual_seed(0)
    net = CallerNet()
    self.assert_trains_as_without_fsdp(
        net,
        lambda net: FSDP(net, auto_wrap_policy=policy, flatten_parameters=True))

  def test_unit_used_twice_trains_without_resharding_after_forward(self):
    # (Stock trains this. A free after the first use's post-backward hook
    # left the second use's checkpointed layers a freed parameter.)
    net = make_net(UsedTwice, inner_checkpoint='checkpoint_module')
    self.assert_trains_as_without_fsdp(
        net, lambda net: wrap(net, reshard_after_forward=False))


def weight_hlo(model, phase):
  """The HLO (as torch_xla 2.9 prints it) that computes the first block's
  ``fc1.weight`` as that layer runs its ``phase`` ('forward' or 'backward')
  in a training step."""
  texts = {}
  fc1 = model.blocks[0].fc1

  def hook(*args):
    texts.setdefault(phase, torch_xla._XLAC._get_xla_tensors_hlo([fc1.weight]))

  handle = (
      fc1.register_forward_hook(hook)
      if phase == 'forward' else fc1.register_full_backward_pre_hook(hook))
  x, y = make_batch()
  F.cross_entropy(model(x), y).backward()
  handle.remove()
  return texts[phase]


class TestCopiedOutAlone(test_utils.XlaTestCase):
  """Each gather copies the original parameters out of the flat parameter
  as 1-D ranges behind an optimization barrier, and reshapes them behind
  it: a compiler then converts or reshapes each parameter alone (on TPU, a
  view let it convert the whole gathered unit to bfloat16, or reshape all
  of it to a [N, 16] that (8, 128) tiles pad 8 times)."""

  def assert_reshaped_from_a_range_behind_a_barrier(self, hlo):
    made = dict(
        re.findall(r'^\s*(?:ROOT )?(%\S+) = (.*)$', hlo, flags=re.MULTILINE))
    root = re.search(r'ROOT %\S+ = \(f32\[300,100\]\S*\) tuple\(\S+ (%\S+)\)',
                     hlo)
    self.assertIsNotNone(root, hlo)
    weight = root.group(1)
    # (stock: a reshape of a slice of the flat parameter; a reshape before the
    # barrier, which copied out f32[300,100], would let the compiler reshape
    # the whole flat parameter)
    self.assertRegex(made[weight],
                     r'reshape\(f32\[30000\]\S* %get-tuple-element')
    copied = re.search(r'(%get-tuple-element\S*)\)', made[weight]).group(1)
    barrier = re.search(r'get-tuple-element\(\((.*)\) %opt-barrier',
                        made.get(copied, ''))
    self.assertIsNotNone(barrier, hlo)
    # all the unit's parameters (fc1's and fc2's weights and biases), as 1-D
    # ranges
    self.assertNotRegex(barrier.group(1), r'\[\d+,')
    self.assertEqual(len(re.findall(r'f32\[\d+\]', barrier.group(1))), 4)

  def test_copied_out_for_forward(self):
    self.assert_reshaped_from_a_range_behind_a_barrier(
        weight_hlo(wrap(make_net()), 'forward'))

  def test_copied_out_again_for_backward(self):
    self.assert_reshaped_from_a_range_behind_a_barrier(
        weight_hlo(wrap(make_net()), 'backward'))


class TestUseOfAFreedParameter(test_utils.XlaTestCase):

  def test_read_by_attribute_raises_naming_it(self):
    # (stock: the view kept the forward's data alive and this trained)
    model = wrap(make_net(ReadsWeight))
    x, _ = make_batch()
    with self.assertRaisesRegex(
        RuntimeError,
        r"Parameter 'fc1\.weight' of the FSDP unit wrapping Block is "
        r"used while the unit has freed it.*reshard_after_forward=False"):
      model(x)

  def test_elementwise_use_raises(self):
    # (a one-element placeholder would broadcast: a wrong value, no error)
    model = wrap(make_net(Regularized))
    x, _ = make_batch()
    with torch.no_grad(), self.assertRaisesRegex(
        RuntimeError,
        r"Parameter 'fc2\.weight' of the FSDP unit wrapping Block"):
      model(x)

  def test_use_before_the_first_forward_raises(self):
    # (stock: a view of the flat parameter, whose data is then the shard)
    model = wrap(make_net())
    with self.assertRaisesRegex(
        RuntimeError,
        r"Parameter 'fc2\.weight' of the FSDP unit wrapping Block.*"
        "Before the model's first forward: initialize parameters"):
      model.blocks[1].fc2.weight.sum()

  def test_submodule_shared_with_another_unit_raises(self):
    # (stock: the views of the unit's forward; FSDP does not gather the
    # parameters at a call that not every rank may make)
    model = wrap(make_net(SharedWithRoot))
    x, _ = make_batch()
    with self.assertRaisesRegex(
        RuntimeError,
        r"Parameter 'head\.weight' of the FSDP unit wrapping Block is "
        r"used while the unit has freed it.*reshard_after_forward=False"):
      model(x)

  def test_probe_between_steps_raises_without_collectives(self):
    # (stock: the weights of the last forward; an all-gather here would be
    # issued only by the ranks that make the call)
    model = wrap(make_net())
    x, _ = make_batch()
    with torch.no_grad():
      model(x)
      with count_collectives(model) as collectives, self.assertRaisesRegex(
          RuntimeError,
          r"Parameter 'fc1\.weight' of the FSDP unit wrapping Block"):
        model.blocks[0].fc1(x)
    self.assertEqual(collectives['all_gather'], 0)

  def test_shared_submodule_trains_without_resharding_after_forward(self):
    # The remedy the error gives: with reshard_after_forward=False a unit
    # keeps its parameters gathered from its forward to its backward.
    losses = train_losses(
        wrap(make_net(SharedWithRoot), reshard_after_forward=False))
    torch.testing.assert_close(
        losses,
        train_losses(make_net(SharedWithRoot).to(torch_xla.device())),
        rtol=1e-5,
        atol=0)


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
