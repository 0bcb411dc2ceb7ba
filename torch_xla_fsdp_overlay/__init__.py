"""Serve ``torch_xla.distributed.fsdp`` from this checkout.

Installed through ``torch_xla_fsdp_overlay.pth`` (see ``setup.py``), a
meta-path finder resolves ``torch_xla.distributed.fsdp`` and its submodules to
the files in this repository's ``torch_xla/distributed/fsdp/``, while the rest
of torch_xla comes from the stock wheel. Nothing is copied into
site-packages.

Environment:
  TORCH_XLA_FSDP_OVERLAY=0  use the stock wheel's fsdp package.

The fsdp files are written against one torch_xla release (``upstream_base.json``).
With another torch_xla installed the overlay stays off and warns once, since
mixing the files with a different torch_xla could break silently.
"""

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import sys
import warnings

PACKAGE = 'torch_xla.distributed.fsdp'
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(ROOT, *PACKAGE.split('.'))
ENV_VAR = 'TORCH_XLA_FSDP_OVERLAY'


def _base_version() -> str:
  with open(os.path.join(ROOT, 'upstream_base.json')) as f:
    return json.load(f)['torch_xla_version']


class FsdpOverlayFinder(importlib.abc.MetaPathFinder):
  """Finds ``torch_xla.distributed.fsdp[.*]`` in this checkout."""

  def __init__(self):
    self._enabled = None

  def enabled(self) -> bool:
    if self._enabled is None:
      self._enabled = self._check_version()
    return self._enabled

  @staticmethod
  def _check_version() -> bool:
    try:
      installed = importlib.metadata.version('torch-xla')
    except importlib.metadata.PackageNotFoundError:
      return False
    expected = _base_version()
    if installed.split('+')[0] != expected:
      warnings.warn(
          f'torch_xla_fsdp_overlay: this checkout patches torch_xla '
          f'{expected}, but torch_xla {installed} is installed; using the '
          f"installed torch_xla's own {PACKAGE}. Install torch-xla=={expected} "
          f'(or set {ENV_VAR}=0 to silence this warning).',
          RuntimeWarning,
          stacklevel=2)
      return False
    return True

  def find_spec(self, fullname, path=None, target=None):
    if fullname != PACKAGE and not fullname.startswith(PACKAGE + '.'):
      return None
    if not self.enabled():
      return None
    rel = fullname[len(PACKAGE):].lstrip('.').replace('.', os.sep)
    if not rel:
      return importlib.util.spec_from_file_location(
          fullname,
          os.path.join(PACKAGE_DIR, '__init__.py'),
          submodule_search_locations=[PACKAGE_DIR])
    candidate = os.path.join(PACKAGE_DIR, rel + '.py')
    if os.path.isfile(candidate):
      return importlib.util.spec_from_file_location(fullname, candidate)
    return None


def install() -> None:
  """Called from the ``.pth`` file at interpreter start-up."""
  if os.environ.get(ENV_VAR, '1') == '0':
    return
  if any(isinstance(f, FsdpOverlayFinder) for f in sys.meta_path):
    return
  sys.meta_path.insert(0, FsdpOverlayFinder())
