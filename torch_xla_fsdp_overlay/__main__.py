"""``python -m torch_xla_fsdp_overlay``: is the FSDP fix active here?

Prints where ``torch_xla.distributed.fsdp`` is served from, the torch_xla
version the fix was written for and the one installed; exits 0 when the fix is
active and 1 when it is not. Paste its output into a bug report.
"""

import importlib.util
import os
import sys

import torch_xla_fsdp_overlay as overlay


def _stock_fsdp_dir():
  spec = importlib.util.find_spec('torch_xla')
  if spec is None or not spec.submodule_search_locations:
    return None
  return os.path.join(
      list(spec.submodule_search_locations)[0], 'distributed', 'fsdp')


def main() -> int:
  if not overlay.enabled_by_env():
    reason = f'{overlay.ENV_VAR}=0'
  elif overlay.installed_finder() is None:
    reason = ('torch_xla_fsdp_overlay.pth did not run at start-up: install '
              'the package (not only put it on sys.path), and do not run '
              'python with -S')
  else:
    reason = overlay.inactive_reason()
  active = reason is None
  served = overlay.fsdp_dir() if active else _stock_fsdp_dir()
  print(f'torch-xla-fsdp-flatten-fix {overlay.__version__}: the fix for '
        'FSDP flatten_parameters=True (pytorch/xla#5464) is ' +
        ('ACTIVE' if active else f'NOT ACTIVE ({reason})'))
  rows = [
      (f'{overlay.PACKAGE} from', served or 'not found'),
      ('fixed files', overlay.fsdp_dir() or 'missing'),
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
