"""Simulated world sizes on one device, for this repository's FSDP tests
and benchmarks (several CPU devices deadlock in collectives with torch_xla
2.9). Importing this module sets no XLA flag."""

import contextlib

import torch_xla.runtime as xr


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
