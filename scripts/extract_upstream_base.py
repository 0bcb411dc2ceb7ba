#!/usr/bin/env python3
"""Extract the pristine upstream FSDP files from the pinned torch_xla wheel.

``upstream_base.json`` (repository root) records the base: the torch_xla
version and wheel, the pytorch/xla commit whose files are identical, and the
sha256 of every file. This script downloads that wheel from PyPI (or takes
one given with ``--wheel``), extracts the files and checks them against the
manifest.

  python scripts/extract_upstream_base.py --verify   # compare the checkout
  python scripts/extract_upstream_base.py --write    # restore the base files
  python scripts/extract_upstream_base.py --verify --against-base
                                 # compare the files at the base commit
"""

import argparse
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from upstream_base import ROOT, base_commit, load_manifest


def sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def download_wheel(manifest, dest: str) -> str:
  cmd = [
      sys.executable, '-m', 'pip', 'download', '--no-deps', '--only-binary',
      ':all:', '--dest', dest, '--python-version', manifest['python_version'],
      '--platform', manifest['platform'],
      f"torch-xla=={manifest['torch_xla_version']}"
  ]
  print('+', ' '.join(cmd), flush=True)
  subprocess.run(cmd, check=True)
  wheels = glob.glob(os.path.join(dest, manifest['wheel']))
  if not wheels:
    sys.exit(f"error: pip did not download {manifest['wheel']}")
  return wheels[0]


def read_from_wheel(wheel: str, manifest) -> dict:
  files = {}
  with zipfile.ZipFile(wheel) as zf:
    for rel in manifest['files']:
      try:
        files[rel] = zf.read(rel)
      except KeyError:
        sys.exit(f'error: {rel} is not in {os.path.basename(wheel)}')
  return files


def read_checkout(manifest, at_commit=None) -> dict:
  files = {}
  for rel in manifest['files']:
    if at_commit:
      files[rel] = subprocess.run(
          ['git', '-C', ROOT, 'show', f'{at_commit}:{rel}'],
          check=True,
          capture_output=True).stdout
    else:
      with open(os.path.join(ROOT, rel), 'rb') as f:
        files[rel] = f.read()
  return files


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      '--wheel', help='a torch_xla wheel to use instead of downloading')
  mode = parser.add_mutually_exclusive_group(required=True)
  mode.add_argument(
      '--verify',
      action='store_true',
      help='check the files (checkout or base commit) against the wheel')
  mode.add_argument(
      '--write',
      action='store_true',
      help='write the pristine files into the checkout')
  parser.add_argument(
      '--against-base',
      action='store_true',
      help='with --verify: read the files at the base commit, not the tree')
  args = parser.parse_args()

  manifest = load_manifest()
  with tempfile.TemporaryDirectory() as tmp:
    wheel = args.wheel or download_wheel(manifest, tmp)
    extracted = read_from_wheel(wheel, manifest)

  bad = [
      rel for rel, data in extracted.items()
      if sha256(data) != manifest['files'][rel]
  ]
  if bad:
    sys.exit('error: the wheel does not match upstream_base.json: ' +
             ', '.join(bad))
  print(f"wheel matches upstream_base.json ({len(extracted)} files, "
        f"torch_xla {manifest['torch_xla_version']}, pytorch/xla "
        f"{manifest['pytorch_xla_commit'][:12]})")

  if args.write:
    for rel, data in extracted.items():
      path = os.path.join(ROOT, rel)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, 'wb') as f:
        f.write(data)
    print(f'wrote {len(extracted)} files')
    return

  ours = read_checkout(
      manifest, at_commit=base_commit() if args.against_base else None)
  changed = [rel for rel in extracted if ours[rel] != extracted[rel]]
  where = 'base commit' if args.against_base else 'checkout'
  if changed:
    print(f'{where} differs from the pristine base in: ' + ', '.join(changed))
    if args.against_base:
      sys.exit(1)
  else:
    print(f'{where} is identical to the pristine base')


if __name__ == '__main__':
  main()
