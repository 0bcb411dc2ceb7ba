"""The wheel and the sdist give users the fix, with no checkout left behind.

Builds the package from a copy of the checkout (``pip wheel``, and ``python -m
build``: an sdist, then the wheel built from it), removes the copy, installs
each wheel into a fresh virtual environment that sees this environment's torch
and torch_xla (``Venv``), and checks there what a user gets.
This repository's check, not part of the upstream series.
"""

import glob
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
import unittest
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP_DIR = os.path.join(ROOT, 'torch_xla', 'distributed', 'fsdp')
PACKAGE = 'torch_xla_fsdp_overlay'

# Imports the fsdp package and two of its modules in a fresh process and
# reports where they came from and the overlay's warnings.
PROBE = r'''
import json, warnings
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter('always')
  import torch_xla.distributed.fsdp as fsdp
  import torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel as m
  import torch_xla.distributed.fsdp.wrap
print(json.dumps({
    'package': fsdp.__file__,
    'module': m.__file__,
    'warnings': [str(w.message) for w in caught
                 if 'torch_xla_fsdp_overlay' in str(w.message)],
}))
'''


def run(args, env=None, check=True):
  return subprocess.run(
      args,
      env=dict(os.environ, PJRT_DEVICE='CPU', **(env or {})),
      check=check,
      capture_output=True,
      text=True)


def read(path):
  with open(path, 'rb') as f:
    return f.read()


class Venv:
  """A virtual environment with one wheel installed, over this one's."""

  def __init__(self, parent, wheel):
    self.path = os.path.join(parent, 'venv')
    # venv makes an environment over the *base* interpreter, also when run
    # from a virtual environment, so --system-site-packages alone shows the
    # base's packages, not those of the environment running this test.
    run([sys.executable, '-m', 'venv', self.path])
    self.python = os.path.join(self.path, 'bin', 'python')
    self.site = run([
        self.python, '-c',
        'import sysconfig; print(sysconfig.get_paths()["purelib"])'
    ]).stdout.strip()
    # This environment's site directories, after the new one's own (so its
    # wheel comes first), as plain sys.path entries: Python runs the .pth
    # files of a site directory only, so this environment's own install of
    # the overlay (an editable one) is not run there.
    dirs = site.getsitepackages()
    if site.ENABLE_USER_SITE:
      dirs.append(site.getusersitepackages())
    with open(os.path.join(self.site, '_running_environment.pth'), 'w') as f:
      f.write(''.join(f'{d}\n' for d in dirs if os.path.isdir(d)))
    # torch and torch_xla are this environment's; --force-reinstall installs
    # this wheel here even where this environment has the project installed.
    run([
        self.python, '-m', 'pip', 'install', '--no-index', '--no-deps',
        '--force-reinstall', '--quiet', wheel
    ])

  def probe(self, **env):
    out = run([self.python, '-c', PROBE], env=env).stdout
    return json.loads(out.strip().splitlines()[-1])

  def check_command(self, **env):
    return run([self.python, '-m', PACKAGE], env=env, check=False)


class TestFsdpPackage(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    cls.tmp = tempfile.mkdtemp()
    cls.addClassCleanup(shutil.rmtree, cls.tmp, ignore_errors=True)
    src = os.path.join(cls.tmp, 'src')
    # The working tree as a clone of it would have it (tracked and new files,
    # nothing that git ignores), so the built files match this checkout.
    files = run(
        ['git', '-C', ROOT, 'ls-files', '-z', '-c', '-o',
         '--exclude-standard']).stdout.split('\0')
    for name in filter(None, files):
      if os.path.isfile(os.path.join(ROOT, name)):
        os.makedirs(os.path.join(src, os.path.dirname(name)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), os.path.join(src, name))
    cls.wheels = {}
    out = os.path.join(cls.tmp, 'pip-wheel')
    run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '-w', out, src])
    cls.wheels['pip wheel'] = glob.glob(os.path.join(out, '*.whl'))[0]
    out = os.path.join(cls.tmp, 'build')
    # Without --sdist or --wheel, build makes the sdist and then the wheel
    # from the sdist.
    run([sys.executable, '-m', 'build', '--outdir', out, src])
    cls.sdist = glob.glob(os.path.join(out, '*.tar.gz'))[0]
    cls.wheels['sdist, then its wheel'] = glob.glob(os.path.join(out,
                                                                 '*.whl'))[0]
    shutil.rmtree(src)

  def venv(self, wheel):
    parent = tempfile.mkdtemp(dir=self.tmp)
    self.addCleanup(shutil.rmtree, parent, ignore_errors=True)
    return Venv(parent, wheel)

  def test_wheel_holds_the_overlay_and_the_fixed_files_only(self):
    for how, wheel in self.wheels.items():
      with self.subTest(how), zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if '.dist-info/' not in n]
        fixed = sorted(os.listdir(FSDP_DIR))
        self.assertEqual(
            sorted(names),
            sorted([
                f'{PACKAGE}.pth', f'{PACKAGE}/__init__.py',
                f'{PACKAGE}/__main__.py'
            ] + [f'{PACKAGE}/_fsdp/{n}' for n in fixed if n.endswith('.py')]))
        for name in fixed:
          if name.endswith('.py'):
            self.assertEqual(
                zf.read(f'{PACKAGE}/_fsdp/{name}'),
                read(os.path.join(FSDP_DIR, name)), name)

  def test_installed_wheel_serves_its_own_fixed_files(self):
    for how, wheel in self.wheels.items():
      with self.subTest(how):
        venv = self.venv(wheel)
        got = venv.probe()
        self.assertEqual(got['warnings'], [])
        fixed = os.path.join(venv.site, PACKAGE, '_fsdp')
        for key in ('package', 'module'):
          self.assertEqual(os.path.dirname(got[key]), fixed)
          self.assertEqual(
              read(got[key]),
              read(os.path.join(FSDP_DIR, os.path.basename(got[key]))))
        check = venv.check_command()
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
        self.assertIn('is ACTIVE', check.stdout)
        self.assertIn(fixed, check.stdout)

  def test_env_var_gives_stock_and_the_check_says_so(self):
    venv = self.venv(self.wheels['pip wheel'])
    got = venv.probe(TORCH_XLA_FSDP_OVERLAY='0')
    self.assertEqual(got['warnings'], [])
    self.assertNotIn(PACKAGE, got['module'])
    self.assertTrue(
        got['module'].endswith(
            os.path.join('torch_xla', 'distributed', 'fsdp',
                         'xla_fully_sharded_data_parallel.py')), got['module'])
    check = venv.check_command(TORCH_XLA_FSDP_OVERLAY='0')
    self.assertEqual(check.returncode, 1, check.stdout + check.stderr)
    self.assertIn('NOT ACTIVE (TORCH_XLA_FSDP_OVERLAY=0)', check.stdout)

  def test_other_torch_xla_version_warns_once_and_loads_stock(self):
    venv = self.venv(self.wheels['pip wheel'])
    # Metadata of a torch_xla 2.8.0 ahead of the system's on sys.path: the
    # version the overlay reads; the code imported stays the system's 2.9.0.
    fake = os.path.join(venv.site, 'torch_xla-2.8.0.dist-info')
    os.makedirs(fake)
    with open(os.path.join(fake, 'METADATA'), 'w') as f:
      f.write('Metadata-Version: 2.1\nName: torch-xla\nVersion: 2.8.0\n')
    got = venv.probe()
    self.assertNotIn(PACKAGE, got['module'])
    self.assertEqual(len(got['warnings']), 1, got['warnings'])
    self.assertIn('NOT active', got['warnings'][0])
    self.assertIn('torch_xla 2.8.0 is installed', got['warnings'][0])
    check = venv.check_command()
    self.assertEqual(check.returncode, 1, check.stdout + check.stderr)
    self.assertIn('torch_xla 2.8.0 is installed', check.stdout)


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
