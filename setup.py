"""Installs the FSDP flatten_parameters fix over a stock torch_xla wheel.

``pip install ".[dev]"`` installs the pinned torch and torch_xla and a single
file, ``torch_xla_fsdp_overlay.pth``, into site-packages. At interpreter
start-up it loads ``torch_xla_fsdp_overlay`` from this checkout, which makes
``import torch_xla.distributed.fsdp`` load this checkout's files. Nothing else
is copied: edits to the checkout take effect at once, and moving the checkout
needs a re-install. ``TORCH_XLA_FSDP_OVERLAY=0`` turns the overlay off.
"""

import os
import sys
import sysconfig

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
OVERLAY = os.path.join(HERE, 'torch_xla_fsdp_overlay', '__init__.py')
PTH = os.path.join('build', 'torch_xla_fsdp_overlay.pth')

# A .pth file runs lines that start with "import" when Python starts. It
# names the checkout by absolute path, so it is written at build time.
os.makedirs(os.path.join(HERE, 'build'), exist_ok=True)
with open(os.path.join(HERE, PTH), 'w') as f:
  f.write(f'import os, runpy; f = {OVERLAY!r}; os.path.isfile(f) and '
          "runpy.run_path(f, run_name='torch_xla_fsdp_overlay')['install']()\n")

setup(
    name='torch-xla-fsdp-flatten-fix',
    version='0.1.0',
    description=('XlaFullyShardedDataParallel(flatten_parameters=True) memory '
                 'fix (pytorch/xla#5464), as an overlay over torch_xla 2.9.0'),
    license='BSD-3-Clause',
    python_requires='>=3.10',
    packages=[],
    # data_files are relative to the installation prefix; this is
    # site-packages for the interpreter that runs the install.
    data_files=[(os.path.relpath(sysconfig.get_paths()['purelib'],
                                 sys.prefix), [PTH])],
    install_requires=[
        'torch==2.9.0',
        'torch-xla==2.9.0',
        'expecttest',
        'pytest',
    ],
    extras_require={
        'dev': ['yapf==0.40.2', 'matplotlib'],
        # the transformers models of benchmarks/fsdp_real_models.py
        'models': ['transformers==5.25.0'],
    },
)
