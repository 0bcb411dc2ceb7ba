"""The checkout's torch_xla.distributed.fsdp overlays the stock wheel."""

import importlib.metadata
import json
import os
import runpy
import subprocess
import sys
import unittest
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP_DIR = os.path.join(ROOT, 'torch_xla', 'distributed', 'fsdp')
PRINT_FILE = (
    'import torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel'
    ' as m; print(m.__file__)')


def fsdp_file(env_overrides):
  env = dict(os.environ, **env_overrides)
  out = subprocess.run([sys.executable, '-c', PRINT_FILE],
                       env=env,
                       check=True,
                       capture_output=True,
                       text=True).stdout
  return out.strip().splitlines()[-1]


class TestFsdpOverlay(unittest.TestCase):

  def test_overlay_serves_checkout_files(self):
    import torch_xla.distributed.fsdp as fsdp
    import torch_xla.distributed.fsdp.utils as utils
    self.assertEqual(
        os.path.dirname(os.path.realpath(fsdp.__file__)),
        os.path.realpath(FSDP_DIR))
    self.assertEqual(
        os.path.dirname(os.path.realpath(utils.__file__)),
        os.path.realpath(FSDP_DIR))

  def test_rest_of_torch_xla_is_stock(self):
    import torch_xla
    self.assertFalse(
        os.path.realpath(
            torch_xla.__file__).startswith(os.path.realpath(ROOT) + os.sep))

  def test_env_var_turns_overlay_off(self):
    stock = fsdp_file({'TORCH_XLA_FSDP_OVERLAY': '0'})
    self.assertIn('site-packages', stock)
    self.assertFalse(
        os.path.realpath(stock).startswith(os.path.realpath(ROOT) + os.sep))
    overlaid = fsdp_file({'TORCH_XLA_FSDP_OVERLAY': '1'})
    self.assertEqual(
        os.path.dirname(os.path.realpath(overlaid)), os.path.realpath(FSDP_DIR))

  def test_other_torch_xla_version_warns_and_falls_back(self):
    overlay = runpy.run_path(
        os.path.join(ROOT, 'torch_xla_fsdp_overlay', '__init__.py'))
    finder = overlay['FsdpOverlayFinder']()
    with mock.patch.object(importlib.metadata, 'version', return_value='2.8.0'):
      with self.assertWarnsRegex(RuntimeWarning, r'torch_xla 2\.8\.0'):
        spec = finder.find_spec('torch_xla.distributed.fsdp')
    self.assertIsNone(spec)

  def test_base_version_matches_installed(self):
    with open(os.path.join(ROOT, 'upstream_base.json')) as f:
      base = json.load(f)
    self.assertEqual(
        importlib.metadata.version('torch-xla').split('+')[0],
        base['torch_xla_version'])


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
