"""Helpers for the FSDP tests: simulated world sizes on one device, and
counting the collectives FSDP issues. Importing this module sets no XLA
flag."""

import contextlib
import types

import torch
import torch.nn as nn
import torch_xla.runtime as xr
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP


@contextlib.contextmanager
def simulated_world_size(world_size: int, rank: int = 0):
  """Make FSDP see ``world_size`` ranks on a single XLA device.

  ``xr.world_size()`` and ``xr.global_ordinal()`` are patched while the
  context is active (construction *and* training), and the FSDP kwargs it
  yields replace the collectives by the ``_debug_dummy_*`` ops, which have
  the shapes of real collectives. Each rank's parameter shards are then what
  that rank would hold: sharded state, padding and the sizes of gathered
  buffers are those of a real run. The values exchanged are not (every
  "rank" gathers its own shard repeated) unless the test replaces the
  collectives itself.

  Yields:
    dict of FSDP constructor kwargs to pass (empty for ``world_size == 1``).
  """
  if world_size < 1:
    raise ValueError(f'world_size must be >= 1, got {world_size}')
  if not 0 <= rank < world_size:
    raise ValueError(f'rank must be in [0, {world_size}), got {rank}')
  if world_size == 1:
    yield {}
    return
  orig = (xr.world_size, xr.global_ordinal)
  xr.world_size = lambda: world_size
  xr.global_ordinal = lambda: rank
  try:
    yield dict(
        _debug_dummy_all_gather_op=True,
        _debug_dummy_all_reduce_op=True,
        _debug_dummy_reduce_scatter_op=True)
  finally:
    xr.world_size, xr.global_ordinal = orig


def torch_checkpoint(function, *args, use_reentrant):
  """``torch.utils.checkpoint.checkpoint`` of XLA tensors, without their RNG
  state: it looks up the device module of its inputs' device (``torch.xla``,
  which torch_xla does not register) even then, and an empty one does."""
  if not hasattr(torch, 'xla'):
    torch._register_device_module('xla', types.ModuleType('torch.xla'))
  return torch.utils.checkpoint.checkpoint(
      function, *args, use_reentrant=use_reentrant, preserve_rng_state=False)


class _CountingReduceScatter:
  """Forwards to an FSDP reduce-scatter op, counting the tensors it takes."""

  def __init__(self, op, counts):
    object.__setattr__(self, '_op', op)
    object.__setattr__(self, '_counts', counts)

  def __call__(self, input, callback):
    self._counts['reduce_scatter'] += 1
    return self._op(input, callback)

  def __getattr__(self, name):
    return getattr(self._op, name)

  def __setattr__(self, name, value):
    setattr(self._op, name, value)


@contextlib.contextmanager
def count_collectives(model: nn.Module):
  """Count the all-gathers and reduce-scatters FSDP issues while active.

  Counted where FSDP calls them, which works alike for real collectives
  (with ``pin_layout=True`` an all-gather lowers to an all-reduce in HLO)
  and for the simulated ones.
  """
  counts = {'all_gather': 0, 'reduce_scatter': 0}
  units = [m for m in model.modules() if isinstance(m, FSDP)]
  saved = [(m.all_gather_op, m.reduce_scatter_op) for m in units]

  def counting_all_gather(op):

    def all_gather(*args, **kwargs):
      counts['all_gather'] += 1
      return op(*args, **kwargs)

    return all_gather

  for m, (all_gather_op, reduce_scatter_op) in zip(units, saved):
    m.all_gather_op = counting_all_gather(all_gather_op)
    m.reduce_scatter_op = _CountingReduceScatter(reduce_scatter_op, counts)
  try:
    yield counts
  finally:
    for m, (all_gather_op, reduce_scatter_op) in zip(units, saved):
      m.all_gather_op = all_gather_op
      m.reduce_scatter_op = reduce_scatter_op
