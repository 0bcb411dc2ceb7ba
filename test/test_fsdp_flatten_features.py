"""flatten_parameters=True with the other FSDP features.

This repository's suite, not part of the upstream change (whose tests are
test_fsdp_flatten_parity.py and test_fsdp_flatten_freed_params.py):
features whose behaviour the change leaves as it was.

Each feature trains the same nested model (test_fsdp_flatten_parity.Net) for
a few steps with flatten_parameters=True and is compared with
flatten_parameters=False: losses and the consolidated checkpoint, to
float32 rounding (more on backends other than the CPU, and with
low-precision compute).
"""

import functools
import os
import sys
import tempfile
import unittest
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr
from torch_xla.distributed.fsdp import (XlaFullyShardedDataParallel as FSDP,
                                        checkpoint_module)
from torch_xla.distributed.fsdp.state_dict_utils import (
    consolidate_sharded_model_checkpoints, consolidate_sharded_state_dicts)
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

import test_utils
from fsdp_simulation import simulated_world_size
from test_fsdp_flatten_parity import Block, Net

STEPS = 3
# (the two graphs compute the same values, which compilers may fuse and
# order differently)
RTOL = 1e-6 if xr.device_type() == 'CPU' else 1e-4


class SharedBlock(Block):
  """A module reached twice, and a parameter of two modules, in one unit;
  both uses of each are in forward."""

  def __init__(self, dim=100, hidden=300):
    super().__init__(dim, hidden)
    self.mid = nn.Linear(hidden, hidden)
    self.mid_again = self.mid
    self.out = nn.Linear(hidden, dim)
    self.out.weight = self.fc2.weight

  def forward(self, x):
    h = F.relu(self.mid(F.relu(self.fc1(x))))
    h = F.relu(self.mid_again(h))
    return x + self.fc2(h) + self.out(h)


class SometimesBlock(Block):
  """``extra`` is used only while ``use_extra``: in the other steps its
  parameters get no gradient."""

  def __init__(self, dim=100, hidden=300):
    super().__init__(dim, hidden)
    self.extra = nn.Linear(dim, dim)
    self.use_extra = False

  def forward(self, x):
    x = super().forward(x)
    return x + self.extra(x) if self.use_extra else x


def make_net(features):
  """The unwrapped model with ``features`` (a set of names)."""
  torch.manual_seed(0)
  net = Net()
  if 'frozen' in features:
    net.blocks[1].fc1.requires_grad_(False)
  if 'batchnorm' in features:
    # ops whose size checks read a tensor's creation-time metadata
    for block in net.blocks:
      block.fc1 = nn.Sequential(block.fc1, nn.BatchNorm1d(300))
  if 'tied' in features:
    net.blocks[0] = SharedBlock()
  if features & {'unused_some_steps', 'unused_all_steps'}:
    net.blocks[1] = SometimesBlock()
  if 'shared_with_root' in features:
    net.blocks[1].head = net.head  # a module of two units (blocks.1 flattens)
  if 'wrapped_twice' in features:
    net.blocks.append(net.blocks[0])
  if 'reachable_from_root' in features:
    net.first_fc1 = net.blocks[0].fc1  # a handle, never called by the root
  if 'checkpoint_inside' in features:
    # two recomputes in one unit's backward
    for block in net.blocks:
      block.fc1 = checkpoint_module(block.fc1)
      block.fc2 = checkpoint_module(block.fc2)
  return net


def build(feature, flatten_parameters, **kwargs):
  """The model with ``feature``: one feature or several joined by '+'."""
  features = set(feature.split('+'))
  net = make_net(features)
  if features & {'bf16', 'no_sync_bf16'}:
    kwargs['compute_dtype'] = torch.bfloat16
  if 'fp16' in features:
    kwargs['compute_dtype'] = torch.float16
  if 'bf16_fp32_reduce_scatter' in features:
    kwargs.update(compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
  if 'checkpoint' in features:
    kwargs['auto_wrapper_callable'] = (
        lambda m, *args, **kw: FSDP(checkpoint_module(m), *args, **kw))
  if 'no_reshard' in features:
    kwargs['reshard_after_forward'] = False
  policy = functools.partial(
      transformer_auto_wrap_policy, transformer_layer_cls={Block})
  if features & {
      'manual_nesting', 'reused_unit', 'reused_checkpoint_inside',
      'reused_checkpoint_outside'
  }:
    policy = None
    for i, block in enumerate(net.blocks):
      if 'reused_checkpoint_inside' in features:
        block = checkpoint_module(block)
      net.blocks[i] = FSDP(
          block, flatten_parameters=flatten_parameters, **kwargs)
      if 'reused_checkpoint_outside' in features:
        net.blocks[i] = checkpoint_module(net.blocks[i])
    if any(f.startswith('reused_') for f in features):
      # one unit, twice in each forward: with checkpointing, its hooks run
      # once per use
      net.blocks.append(net.blocks[0])
  model = FSDP(
      net,
      auto_wrap_policy=policy,
      flatten_parameters=flatten_parameters,
      **kwargs)
  if 'nonzero_padding' in features:
    # What a shard's padding holds must not reach the parameters.
    with torch.no_grad():
      for unit in model.modules():
        if isinstance(unit, FSDP):
          for p_shard in unit.sharded_params:
            p_shard[p_shard._orig_size.numel():] = 7.0
  return model


def make_batch():
  """The batch every run trains on, at every step and on every rank."""
  device = torch_xla.device()
  generator = torch.Generator().manual_seed(1)
  return (torch.randn(32, 100, generator=generator).to(device),
          torch.randint(0, 10, (32,), generator=generator).to(device))


def to_cpu(state):
  return {
      k:
          to_cpu(v) if isinstance(v, dict) else
          (v.cpu() if isinstance(v, torch.Tensor) else v)
      for k, v in state.items()
  }


def train(feature,
          flatten_parameters,
          steps=STEPS,
          save_to=None,
          resume_from=None,
          momentum=0.9,
          **fsdp_kwargs):
  """Losses and the consolidated checkpoint; optionally resumes from, or
  saves, a sharded checkpoint (model, shard metadata and optimizer state)."""
  features = set(feature.split('+'))
  model = build(feature, flatten_parameters, **fsdp_kwargs)
  optimizer = torch.optim.SGD(
      [p for p in model.parameters() if p.requires_grad],
      lr=0.1,
      momentum=momentum)
  if resume_from is not None:
    ckpt = torch.load(resume_from)
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
  x, y = make_batch()
  losses = []
  for step in range(steps):
    for m in model.modules():
      if isinstance(m, SometimesBlock):
        m.use_extra = 'unused_some_steps' in features and step % 2 == 1
    optimizer.zero_grad()
    if 'eval_first' in features:
      model.eval()
      with torch.no_grad():
        model(x)
      model.train()
    if features & {'no_sync', 'no_sync_bf16'}:  # two micro-batches
      with model.no_sync():
        F.cross_entropy(model(x[:16]), y[:16]).backward()
      loss = F.cross_entropy(model(x[16:]), y[16:])
    elif 'two_forwards' in features:
      loss = (
          F.cross_entropy(model(x[:16]), y[:16]) +
          F.cross_entropy(model(x[16:]), y[16:]))
    else:
      loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    losses.append(loss.item())
  state_dict = to_cpu(model.state_dict())
  if save_to is not None:
    torch.save(
        {
            'model': state_dict,
            'shard_metadata': model.get_shard_metadata(),
            'optimizer': to_cpu(optimizer.state_dict()),
        }, save_to)
  return {
      'losses':
          losses,
      'checkpoint':
          consolidate_sharded_state_dicts([state_dict],
                                          model.get_shard_metadata()),
  }


def train_without_fsdp(feature, steps=STEPS):
  """The losses of ``train(feature, ...)``'s model and loop without FSDP."""
  features = set(feature.split('+'))
  net = make_net(features).to(torch_xla.device())
  if 'tied' in features:
    block = net.blocks[0]
    block.out.weight = block.fc2.weight  # (`to` unties shared parameters)
  optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
  x, y = make_batch()
  losses = []
  for _ in range(steps):
    optimizer.zero_grad()
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    losses.append(loss.item())
  return losses


def train_with_eval_forwards(steps=4):
  """The model with all units resharding not after forward, trained with an
  evaluation forward before each step, and the number of XLA tensors alive
  after each step."""
  model = build('no_reshard', True)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
  x, y = make_batch()
  live = []
  for _ in range(steps):
    with torch.no_grad():
      model(x)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    torch_xla.sync()
    xm.wait_device_ops()
    live.append(
        met.counter_value('CreateXlaTensor') -
        met.counter_value('DestroyXlaTensor'))
  return model, live


class SameBatchRanks:
  """The collectives of ``world_size`` ranks that all train on the same batch,
  each rank a model of its own on this one device, traced into one graph.

  With the same batch and the same initial parameters every rank computes
  the same full gradients, so a real run's collectives are known: an
  all-gather concatenates the ranks' current shards of the parameter, and a
  reduce-scatter sums ``world_size`` equal gradients. Unlike
  ``fsdp_simulation.simulated_world_size`` (one rank, its own shard
  repeated: right for memory, not for values), this trains like a real run,
  so it must match world size 1 and flatten_parameters=False, with padding
  on the last rank and the consolidation of all ranks' shards.
  """

  @classmethod
  def connect(cls, models):
    units = [
        [m for m in model.modules() if isinstance(m, FSDP)] for model in models
    ]
    for rank, rank_units in enumerate(units):
      for i, unit in enumerate(rank_units):
        ranks_of_unit = [u[i] for u in units]
        unit.all_gather_op = functools.partial(cls.all_gather, unit,
                                               ranks_of_unit)
        unit.all_reduce_op = functools.partial(cls.all_reduce, len(models))
        unit.reduce_scatter_op = cls.ReduceScatter(len(models), rank)

  @staticmethod
  def all_gather(unit, ranks_of_unit, shard, groups=None):
    # `shard` is a sharded param, or its 2-D view (`_shard_size_multiple`),
    # or a copy in the compute dtype: then the only one of its size
    base = shard if shard._base is None else shard._base
    found = [i for i, p in enumerate(unit.sharded_params) if p is base] or [
        i for i, p in enumerate(unit.sharded_params)
        if p.numel() == shard.numel()
    ]
    assert len(found) == 1, 'cannot tell which parameter is gathered'
    return torch.cat([
        u.sharded_params[found[0]].to(shard.dtype).view(shard.shape)
        for u in ranks_of_unit
    ])

  @staticmethod
  def all_reduce(world_size, reduce_type, inputs, scale=1.0, groups=None):
    assert reduce_type == 'sum'  # (FSDP's token reader; no clip_grad_norm_)
    return inputs * (world_size * scale)

  class ReduceScatter:

    def __init__(self, world_size, rank):
      self.world_size, self.rank, self.scale = world_size, rank, 1.0

    def __call__(self, input, callback):
      chunk = input.chunk(self.world_size)[self.rank]
      callback(chunk * (self.world_size * self.scale))

    def flush(self):
      pass


def train_same_batch_ranks(world_size,
                           flatten_parameters,
                           feature='plain',
                           steps=STEPS):
  """``train(feature, flatten_parameters)`` by ``world_size`` ranks (see
  ``SameBatchRanks``): rank 0's losses and the consolidated checkpoint."""
  models = []
  for rank in range(world_size):
    with simulated_world_size(world_size, rank) as kwargs:
      models.append(build(feature, flatten_parameters, **kwargs))
  SameBatchRanks.connect(models)
  optimizers = [
      torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
      for model in models
  ]
  x, y = make_batch()
  losses = []
  for _ in range(steps):
    # every rank's backward before any optimizer step: the all-gathers read
    # the other ranks' shards of this step
    rank_losses = []
    for model, optimizer in zip(models, optimizers):
      optimizer.zero_grad()
      rank_losses.append(F.cross_entropy(model(x), y))
      rank_losses[-1].backward()
    for optimizer in optimizers:
      optimizer.step()
    torch_xla.sync()
    losses.append([loss.item() for loss in rank_losses])
  state_dicts = [to_cpu(model.state_dict()) for model in models]
  return {
      'losses': [rank_losses[0] for rank_losses in losses],
      'rank_losses':
          losses,
      'checkpoint':
          consolidate_sharded_state_dicts(state_dicts,
                                          models[0].get_shard_metadata()),
  }


class SameTrainingMixin:

  def assert_same(self, a, b, rtol=RTOL):
    torch.testing.assert_close(a['losses'], b['losses'], rtol=rtol, atol=0)
    self.assertEqual(sorted(a['checkpoint']), sorted(b['checkpoint']))
    for name, value in a['checkpoint'].items():
      torch.testing.assert_close(
          value,
          b['checkpoint'][name],
          rtol=rtol,
          atol=rtol * 1e-1,
          msg=lambda m: f'{name}: {m}')


class TestFlattenFeatures(SameTrainingMixin, test_utils.XlaTestCase):

  def test_same_as_unflattened(self):
    # (features that do not interact are trained together)
    for feature in ('checkpoint+frozen+nonzero_padding+no_sync',
                    'tied+unused_all_steps+no_reshard+eval_first',
                    'manual_nesting+two_forwards+checkpoint_inside',
                    'reused_unit', 'reused_checkpoint_inside',
                    'reused_checkpoint_outside'):
      with self.subTest(feature=feature):
        self.assert_same(train(feature, True), train(feature, False))

  def test_batchnorm_same_as_unflattened(self):
    # (XLA may order BatchNorm's reductions differently in the two graphs:
    # 2 float32 ulps on a loss)
    self.assert_same(train('batchnorm', True), train('batchnorm', False))

  def test_unused_in_some_steps_same_as_unflattened(self):
    # A flat gradient has zeros where flatten_parameters=False has no
    # gradient at all; plain SGD leaves a parameter alone in both cases.
    self.assert_same(
        train('unused_some_steps', True, momentum=0.0),
        train('unused_some_steps', False, momentum=0.0))

  def test_module_only_reachable_from_another_unit(self):
    # A handle to a module of another unit, never called there, changes
    # nothing: no warning, and the unit still frees its parameters after
    # forward.
    for flatten in (True, False):
      with self.subTest(flatten=flatten):
        with warnings.catch_warnings():
          warnings.simplefilter('error')
          losses = train('reachable_from_root', flatten)['losses']
        torch.testing.assert_close(
            losses,
            train_without_fsdp('reachable_from_root'),
            rtol=1e-5,
            atol=0)
        model = build('reachable_from_root', flatten)
        self.assertTrue(
            all(m.reshard_after_forward
                for m in model.modules()
                if isinstance(m, FSDP) and m is not model))

  def test_tied_parameter_trains_as_without_fsdp(self):
    # (an untied copy would get the gradient of only one of its uses)
    for flatten in (True, False):
      with self.subTest(flatten=flatten):
        torch.testing.assert_close(
            train('tied', flatten)['losses'],
            train_without_fsdp('tied'),
            rtol=1e-5,
            atol=0)

  def test_low_precision_close_to_unflattened(self):
    # The two graphs round differently: a flat gradient is cast, divided and
    # (with no_sync) accumulated as one tensor.
    feature = 'no_sync_bf16+bf16_fp32_reduce_scatter'
    self.assert_same(train(feature, True), train(feature, False), rtol=2e-2)
    fp16 = train('fp16', False)
    self.assert_same(train('fp16', True), fp16, rtol=5e-3)
    # with the gradient divided before the reduce-scatter, in float16
    self.assert_same(train_same_batch_ranks(4, True, 'fp16'), fp16, rtol=5e-3)

  def test_world_size_4(self):
    # No unit's parameter count (60400, 1010) is a multiple of world size x
    # 128: every flat parameter is padded, on the last rank.
    flat = train_same_batch_ranks(4, True)
    for rank_losses in flat['rank_losses']:
      self.assertEqual(set(rank_losses), {rank_losses[0]})
    self.assert_same(flat, train_same_batch_ranks(4, False))
    self.assert_same(flat, train('plain', False))  # world size 1

  def test_live_tensors_do_not_grow(self):
    # Units that keep their gathered data between forwards (the root always,
    # here all units) and evaluation forwards between training steps: the
    # original parameters each forward makes must not pile up.
    _, live = train_with_eval_forwards()
    self.assertEqual(len(set(live[1:])), 1, live)


class TestCheckpointRoundTrip(SameTrainingMixin, test_utils.XlaTestCase):

  def test_resume_same_as_never_stopping(self):
    # (the second step is the first with momentum buffers: resuming after
    # one step must restore them)
    with tempfile.TemporaryDirectory() as tmp:
      consolidated = {}
      for flatten in (True, False):
        with self.subTest(flatten=flatten):
          prefix = os.path.join(tmp, f'flatten{int(flatten)}')
          first = train(
              'plain', flatten, steps=1, save_to=prefix + '_rank0.pth')
          resumed = train(
              'plain', flatten, steps=1, resume_from=prefix + '_rank0.pth')
          whole = train('plain', flatten, steps=2)
          resumed['losses'] = first['losses'] + resumed['losses']
          self.assert_same(resumed, whole)
          consolidated[flatten], _ = consolidate_sharded_model_checkpoints(
              prefix, '_rank*.pth', save_model=False)
      # whatever the layout of the shards, the same model
      self.assert_same({
          'losses': [],
          'checkpoint': consolidated[True]
      }, {
          'losses': [],
          'checkpoint': consolidated[False]
      })


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
