"""The checkout's torch_xla.distributed.fsdp overlays the stock wheel.

Run in the contributor's editable install (``pip install -e ".[dev]"``); the
wheel and the sdist are checked by test_fsdp_package.py.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import unittest
import warnings
from unittest import mock

import torch_xla_fsdp_overlay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (not ROOT: a virtual environment may live inside the checkout)
CHECKOUT_TORCH_XLA = os.path.join(ROOT, 'torch_xla')
FSDP_DIR = os.path.join(CHECKOUT_TORCH_XLA, 'distributed', 'fsdp')
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
        os.path.realpath(torch_xla.__file__).startswith(
            os.path.realpath(CHECKOUT_TORCH_XLA) + os.sep))

  def test_env_var_turns_overlay_off(self):
    stock = fsdp_file({'TORCH_XLA_FSDP_OVERLAY': '0'})
    self.assertIn('site-packages', stock)
    self.assertFalse(
        os.path.realpath(stock).startswith(
            os.path.realpath(CHECKOUT_TORCH_XLA) + os.sep))
    overlaid = fsdp_file({'TORCH_XLA_FSDP_OVERLAY': '1'})
    self.assertEqual(
        os.path.dirname(os.path.realpath(overlaid)), os.path.realpath(FSDP_DIR))

  def test_other_torch_xla_version_warns_once_and_falls_back(self):
    finder = torch_xla_fsdp_overlay.FsdpOverlayFinder()
    with mock.patch.object(importlib.metadata, 'version', return_value='2.8.0'):
      with self.assertWarnsRegex(RuntimeWarning, r'torch_xla 2\.8\.0'):
        spec = finder.find_spec('torch_xla.distributed.fsdp')
      with warnings.catch_warnings():
        warnings.simplefilter('error')
        sub = finder.find_spec('torch_xla.distributed.fsdp.wrap')
    self.assertIsNone(spec)
    self.assertIsNone(sub)

  def test_missing_files_warn_and_fall_back(self):
    finder = torch_xla_fsdp_overlay.FsdpOverlayFinder()
    with mock.patch.object(
        torch_xla_fsdp_overlay, 'fsdp_dir', return_value=None):
      with self.assertWarnsRegex(RuntimeWarning, r'fixed files .* missing'):
        spec = finder.find_spec('torch_xla.distributed.fsdp')
    self.assertIsNone(spec)

  def test_check_command_exit_code(self):
    active = subprocess.run([sys.executable, '-m', 'torch_xla_fsdp_overlay'],
                            capture_output=True,
                            text=True)
    self.assertEqual(active.returncode, 0, active.stdout + active.stderr)
    self.assertIn(os.path.realpath(FSDP_DIR), active.stdout)
    off = subprocess.run([sys.executable, '-m', 'torch_xla_fsdp_overlay'],
                         env=dict(os.environ, TORCH_XLA_FSDP_OVERLAY='0'),
                         capture_output=True,
                         text=True)
    self.assertEqual(off.returncode, 1, off.stdout + off.stderr)

  def test_base_version_matches_installed(self):
    with open(os.path.join(ROOT, 'upstream_base.json')) as f:
      version = json.load(f)['torch_xla_version']
    self.assertEqual(torch_xla_fsdp_overlay.TORCH_XLA_VERSION, version)
    self.assertEqual(
        importlib.metadata.version('torch-xla').split('+')[0], version)
    with open(os.path.join(ROOT, 'pyproject.toml')) as f:
      self.assertIn(f'"torch-xla=={version}"', f.read())


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
