"""Serve ``torch_xla.distributed.fsdp`` from this package.

The package carries the fixed ``torch_xla/distributed/fsdp/`` files as its
private subpackage ``torch_xla_fsdp_overlay._fsdp`` (import them only as
``torch_xla.distributed.fsdp``): copied into the wheel at build
time, or the checkout's own files in an editable install. The file
``torch_xla_fsdp_overlay.pth``, installed at the top of site-packages, runs
:func:`install` at interpreter start-up, which puts a meta-path finder in
front of the import system: ``torch_xla.distributed.fsdp`` and its submodules
then load from those files, while the rest of torch_xla comes from the stock
wheel.

Environment (read when Python starts):
  TORCH_XLA_FSDP_OVERLAY=0  use the stock wheel's fsdp package, silently.

The files are written against one torch_xla release (``TORCH_XLA_VERSION``).
With another torch_xla installed, or with the files missing, the overlay stays
off and the first import of ``torch_xla.distributed.fsdp`` warns with the
reason: mixing the files with a different torch_xla could break silently.
``python -m torch_xla_fsdp_overlay`` says whether the fix is active.
"""

import os
import sys
import warnings

__version__ = '0.2.0'
# The torch_xla release whose fsdp files this package patches (the base of
# upstream_base.json).
TORCH_XLA_VERSION = '2.9.0'
PACKAGE = 'torch_xla.distributed.fsdp'
ENV_VAR = 'TORCH_XLA_FSDP_OVERLAY'


def _installed_torch_xla_version():
  import importlib.metadata
  try:
    return importlib.metadata.version('torch-xla')
  except importlib.metadata.PackageNotFoundError:
    return None


def fsdp_dir():
  """The directory of the fixed fsdp files, or None where they are missing."""
  # Imported here, not at start-up, where the .pth file imports this module.
  import importlib.util
  spec = importlib.util.find_spec(__name__ + '._fsdp')
  if spec is None or not spec.submodule_search_locations:
    return None
  path = list(spec.submodule_search_locations)[0]
  if not os.path.isfile(os.path.join(path, '__init__.py')):
    return None
  return path


def inactive_reason():
  """Why the fixed files cannot be served, or None where they can."""
  installed = _installed_torch_xla_version()
  if installed is None:
    return 'torch_xla is not installed'
  if installed.split('+')[0] != TORCH_XLA_VERSION:
    return (f'these files patch torch_xla {TORCH_XLA_VERSION}, but torch_xla '
            f'{installed} is installed: install torch-xla=={TORCH_XLA_VERSION}')
  if fsdp_dir() is None:
    return (f'the fixed files ({__name__}._fsdp) are missing: re-install '
            'torch-xla-fsdp-flatten-fix')
  return None


class FsdpOverlayFinder:
  """Finds ``torch_xla.distributed.fsdp[.*]`` among this package's files."""

  def __init__(self):
    self._dir = None
    self._checked = False

  def directory(self):
    """The fixed files' directory; warns once and gives None if unusable."""
    if not self._checked:
      reason = inactive_reason()
      if reason is not None:
        # stacklevel 3: the import statement, past importlib's frames. Raised
        # as an error (-W error), it is raised again at the next import.
        warnings.warn(
            f'torch_xla_fsdp_overlay: the fix for FSDP flatten_parameters=True '
            f'(pytorch/xla#5464) is NOT active, {PACKAGE} is stock torch_xla\'s: '
            f'{reason} (or set {ENV_VAR}=0 to use stock without this warning).',
            RuntimeWarning,
            stacklevel=3)
      self._dir = fsdp_dir() if reason is None else None
      self._checked = True
    return self._dir

  def find_spec(self, fullname, path=None, target=None):
    if fullname != PACKAGE and not fullname.startswith(PACKAGE + '.'):
      return None
    directory = self.directory()
    if directory is None:
      return None
    import importlib.util
    rel = fullname[len(PACKAGE):].lstrip('.').replace('.', os.sep)
    if not rel:
      return importlib.util.spec_from_file_location(
          fullname,
          os.path.join(directory, '__init__.py'),
          submodule_search_locations=[directory])
    candidate = os.path.join(directory, rel + '.py')
    if os.path.isfile(candidate):
      return importlib.util.spec_from_file_location(fullname, candidate)
    return None


def enabled_by_env() -> bool:
  return os.environ.get(ENV_VAR, '1') != '0'


def installed_finder():
  for finder in sys.meta_path:
    if isinstance(finder, FsdpOverlayFinder):
      return finder
  return None


def install() -> None:
  """Called from ``torch_xla_fsdp_overlay.pth`` at interpreter start-up."""
  if enabled_by_env() and installed_finder() is None:
    sys.meta_path.insert(0, FsdpOverlayFinder())
