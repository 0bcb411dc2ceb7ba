"""Adds ``torch_xla_fsdp_overlay.pth`` to the wheel; the rest is pyproject.toml.

A ``.pth`` file at the top of site-packages is the one thing that
``pyproject.toml`` cannot declare. Python runs its ``import`` line at start-up,
which puts the overlay's import finder in front of torch_xla's own
``torch_xla.distributed.fsdp``. It is written into the wheel's build tree, and
for ``pip install -e`` into the editable wheel (setuptools writes that wheel
from the install command's directory, not from the build tree).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_FILE = 'torch_xla_fsdp_overlay.pth'
PTH_LINE = 'import torch_xla_fsdp_overlay; torch_xla_fsdp_overlay.install()\n'


class BuildPyWithPth(build_py):

  def run(self):
    if not self.editable_mode:
      # A checkout's build/lib is reused between builds: a file deleted from
      # the checkout, or one older than its copy there, would be stale.
      shutil.rmtree(
          os.path.join(self.build_lib, 'torch_xla_fsdp_overlay'),
          ignore_errors=True)
    super().run()
    target = (
        self.get_finalized_command('install').install_lib
        if self.editable_mode else self.build_lib)
    self.mkpath(target)
    with open(os.path.join(target, PTH_FILE), 'w') as f:
      f.write(PTH_LINE)


setup(cmdclass={'build_py': BuildPyWithPth})
