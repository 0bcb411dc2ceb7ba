"""``python -m torch_xla_fsdp_overlay``: is the FSDP fix active here?

Prints where this interpreter imports ``torch_xla.distributed.fsdp`` from (it
imports torch_xla to ask), where the fixed files are and what they were
installed from, the torch_xla version the fix was written for and the one
installed; exits 0 when the fix is active and 1 when it is not. Paste its
output into a bug report.
"""

import importlib.metadata
import importlib.util
import json
import os
import sys

import torch_xla_fsdp_overlay as overlay


def _served_fsdp_dir():
  """Where this process imports torch_xla.distributed.fsdp from, or why not."""
  try:
    spec = importlib.util.find_spec(overlay.PACKAGE)  # imports torch_xla
  except Exception as e:  # torch_xla itself fails to import
    return None, f'torch_xla cannot be imported: {type(e).__name__}: {e}'
  if spec is None or not spec.origin:
    return None, f'{overlay.PACKAGE} is not found'
  return os.path.dirname(spec.origin), None


def _installed_from():
  """The source and commit pip installed this package from, if it says."""
  try:
    dist = importlib.metadata.distribution('torch-xla-fsdp-flatten-fix')
    url = json.loads(dist.read_text('direct_url.json') or 'null')
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return 'unknown'
  if not url:
    return 'a package index'
  commit = url.get('vcs_info', {}).get('commit_id')
  return url.get('url', '?') + (f' @ {commit}' if commit else '')


def main() -> int:
  fixed = overlay.fsdp_dir()
  served, error = _served_fsdp_dir()
  if not overlay.enabled_by_env():
    reason = f'{overlay.ENV_VAR}=0'
  elif overlay.installed_finder() is None:
    reason = ('torch_xla_fsdp_overlay.pth did not run at start-up: install '
              'the package (not only put it on sys.path), and do not run '
              'python with -S')
  else:
    reason = overlay.inactive_reason() or error
  if reason is None and (os.path.realpath(served) != os.path.realpath(fixed)):
    reason = f'another finder serves {overlay.PACKAGE} first'
  active = reason is None
  print(f'torch-xla-fsdp-flatten-fix {overlay.__version__}: the fix for '
        'FSDP flatten_parameters=True (pytorch/xla#5464) is ' +
        ('ACTIVE' if active else f'NOT ACTIVE ({reason})'))
  rows = [
      (f'{overlay.PACKAGE} from', served or error),
      ('fixed files', fixed or 'missing'),
      ('installed from', _installed_from()),
      ('written for torch_xla', overlay.TORCH_XLA_VERSION),
      ('installed torch_xla', overlay._installed_torch_xla_version() or 'none'),
      (overlay.ENV_VAR, os.environ.get(overlay.ENV_VAR, 'unset')),
      ('python', f'{sys.version.split()[0]} ({sys.executable})'),
  ]
  width = max(len(name) for name, _ in rows)
  for name, value in rows:
    print(f'  {name:<{width}}  {value}')
  return 0 if active else 1


if __name__ == '__main__':
  sys.exit(main())
