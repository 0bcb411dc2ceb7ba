"""Helpers for the FSDP tests: activation checkpointing of XLA tensors with
``torch.utils.checkpoint``, and counting the collectives FSDP issues."""

import contextlib
import types

import torch
import torch.nn as nn
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP


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
