"""The step-graph measurement helper and the simulated world sizes.

Stock FSDP is measured with the overlay turned off, in a subprocess each
(the overlay is chosen at import), so these figures stay today's stock
figures whatever the checkout's FSDP does.
"""

import collections
import sys
import unittest

import fsdp_memory_utils as mu

FULL_WEIGHT = f'f32[{mu.HIDDEN},{mu.HIDDEN}]'
FULL_WEIGHT_BYTES = mu.HIDDEN * mu.HIDDEN * 4


def measure(stock, **kwargs):
  return mu.measure_in_subprocess(stock=stock, **kwargs)


@unittest.skipUnless(mu.xr.device_type() == 'CPU',
                     'exact buffer-assignment figures are CPU figures')
class TestStockFigures(unittest.TestCase):
  """The helper reproduces pytorch/xla#5464 on the report's model."""

  @classmethod
  def setUpClass(cls):
    cls.unflat = measure(stock=True, flatten=0)
    cls.flat = measure(stock=True, flatten=1)

  def test_overlay_was_off(self):
    for stats in (self.unflat, self.flat):
      self.assertIn('site-packages', stats['fsdp_file'])

  def test_peak_bytes(self):
    # XLA's buffer assignment is deterministic for the pinned torch_xla.
    self.assertEqual(self.unflat['peak_bytes'], 216_596_540)
    self.assertEqual(self.flat['peak_bytes'], 577_044_496)

  def test_outputs(self):
    # flatten=False: 16 parameter shards and their 16 gradient shards.
    self.assertEqual(
        collections.Counter(self.unflat['output_shapes']), {'f32[1638400]': 32})
    # flatten=True: 2 flat shards + 2 flat gradients, and the leak: 16
    # per-parameter views and the 16 slices they are made from.
    self.assertEqual(
        collections.Counter(self.flat['output_shapes']), {
            'f32[13107200]': 4,
            FULL_WEIGHT: 16,
            'f32[1638400]': 16
        })

  def test_collectives(self):
    # Forward and backward gather each unit once; gradients are
    # reduce-scattered once per (flat) parameter.
    self.assertEqual(self.unflat['num_all_gathers'], 32)
    self.assertEqual(self.unflat['num_reduce_scatters'], 16)
    self.assertEqual(self.flat['num_all_gathers'], 4)
    self.assertEqual(self.flat['num_reduce_scatters'], 2)


class TestSimulatedWorldSize(unittest.TestCase):

  def test_faithful_simulation_grows_by_sharded_state(self):
    # flatten=False at a simulated world size of 8 must grow per layer by
    # what a layer adds for good: its parameter and gradient shards, plus
    # the activations saved for backward. The gathered full parameters of
    # one unit at a time are a constant.
    world_size = 8
    peaks, full_live = {}, {}
    for layers in (2, 4):
      stats = measure(
          stock=True, flatten=0, layers=layers, world_size=world_size)
      peaks[layers] = stats['peak_bytes']
      full_live[layers] = sum(
          1 for _, size in stats['live_at_peak'] if size == FULL_WEIGHT_BYTES)
    per_layer = (peaks[4] - peaks[2]) / 2
    sharded_state = 2 * mu.layer_numel() * 4 // world_size  # params + grads
    activations = 11 * mu.BATCH * mu.HIDDEN * 4  # 8 linears + 3 softmaxes
    self.assertGreaterEqual(per_layer, sharded_state)
    self.assertLessEqual(per_layer, sharded_state + activations)
    self.assertEqual(full_live[2], full_live[4])
    self.assertLessEqual(full_live[4], 8 + 1)  # one unit + one gradient

  def test_world_size_is_restored(self):
    before = mu.xr.world_size()
    with mu.simulated_world_size(4) as kwargs:
      self.assertEqual(mu.xr.world_size(), 4)
      self.assertTrue(kwargs['_debug_dummy_all_gather_op'])
    self.assertEqual(mu.xr.world_size(), before)

  def test_bad_world_size(self):
    with self.assertRaisesRegex(ValueError, 'world_size must be >= 1'):
      with mu.simulated_world_size(0):
        pass


class TestParsing(unittest.TestCase):

  def test_entry_output_shapes(self):
    hlo = ('HloModule m\n\nENTRY %SyncTensorsGraph.9 (p0.1: f32[4]) -> '
           '(f32[4]{0}, /*index=1*/f32[2,2]{1,0}, (s32[], f32[])) {\n'
           '  ROOT %t = tuple()\n}\n')
    self.assertEqual(
        mu.parse_entry_output_shapes(hlo),
        ['f32[4]', 'f32[2,2]', '(s32[], f32[])'])

  def test_buffer_assignment(self):
    text = ('  Live ranges at 7 (peak):\n'
            '    copy.1{}: 400 bytes (cumulative: 400 bytes)\n'
            '    p0.2: 16 bytes (cumulative: 416 bytes)\n'
            '  Stack trace breakdown for peak usage: 1 416 bytes\n')
    peak, live = mu.parse_buffer_assignment(text)
    self.assertEqual(peak, 1416)
    self.assertEqual(live, [('copy.1', 400), ('p0.2', 16)])

  def test_resident_peak_counts_tuple_elements(self):
    # Values inside a tuple are named with their index in both sections;
    # two values in one region (an in-place update) count once.
    text = (
        'allocation 0: size 400, maybe-live-out:\n'
        ' value: <1 all-reduce.81{0} @0> (size=400,offset=0): f32[100]\n'
        'allocation 1: size 64, preallocated-temp:\n'
        ' value: <2 fusion.3 @0> (size=64,offset=0): f32[16]\n'
        ' value: <3 dynamic-update-slice.4 @0> (size=64,offset=0): f32[16]\n'
        '  BufferLiveRange:\n'
        '    all-reduce.81{0}:0-5\n'
        '    fusion.3{}:1-3\n'
        '    dynamic-update-slice.4{}:3-4\n'
        '\n')
    peak, live = mu.parse_resident_peak(text)
    self.assertEqual(peak, 464)
    self.assertEqual(live, [('all-reduce.81{0}', 400), ('fusion.3', 64)])


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
