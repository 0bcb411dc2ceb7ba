"""flatten_parameters=True divides the flat gradient before its barrier.

The post-backward hook puts the gradient behind an optimization barrier
with the unit's shards. Divided by
``gradient_predivide_factor`` only after it, the compiler kept the
undivided flat gradient beside its divided copy. Run with and without
functionalization (``XLA_DISABLE_FUNCTIONALIZATION=1``).
"""

import sys
import unittest

import torch
import torch.nn.functional as F
import torch_xla
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

import test_utils
from test_fsdp_flatten_parity import Net


class TestPredivideBeforeBarrier(test_utils.XlaTestCase):

  def test_flat_gradient_divided_at_the_barrier(self):
    torch.manual_seed(0)
    model = FSDP(Net(), flatten_parameters=True)
    # (the factor of a world size of 4, on one device)
    model.set_gradient_divide_factors(2.0, 2.0, recursive=True)
    shard = model.sharded_params[0]
    grads = []
    barrier = model._apply_opt_barrier_to_params_and_tensors

    def record_and_barrier(params, shards, dependency_tensors):
      # (the post-backward hook's: the flat gradient with the shard)
      if shards == [shard] and [t.shape for t in dependency_tensors
                               ] == [shard._orig_size]:
        grads.append(dependency_tensors[0].cpu())
      barrier(params, shards, dependency_tensors)

    model._apply_opt_barrier_to_params_and_tensors = record_and_barrier
    device = torch_xla.device()
    x = torch.randn(8, 100).to(device)
    F.cross_entropy(model(x),
                    torch.zeros(8, dtype=torch.long).to(device)).backward()
    torch_xla.sync()
    # (stock: divided after the barrier, here still the full gradient)
    reduced = model.sharded_params[0].grad.cpu()[:grads[0].numel()]
    torch.testing.assert_close(grads[0], reduced * 2)


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
