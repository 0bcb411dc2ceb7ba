"""The series of upstream patches (upstream/series) is this checkout.

This repository's check, not part of the upstream change: applied in order
to the pristine base, the patches give exactly the upstream files here, and
each is a commit a reviewer can take on its own.
"""

import os
import re
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'make_upstream_patch.py')


def run(*args):
  return subprocess.run([sys.executable, SCRIPT, *args],
                        capture_output=True,
                        text=True)


class TestUpstreamSeries(unittest.TestCase):

  def test_series_applied_to_the_base_is_the_checkout(self):
    with tempfile.TemporaryDirectory() as tmp:
      out = run('--series', tmp, '--author', 'A Contributor <a@example.com>')
      self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
      names = sorted(os.listdir(tmp))
      texts = []
      for name in names:
        with open(os.path.join(tmp, name)) as f:
          texts.append(f.read())
    self.assertGreaterEqual(len(names), 2)
    fix = [i for i, name in enumerate(names) if 'flatten_parameters' in name]
    self.assertTrue(fix, names)
    self.assertIn('\nFixes #5464.\n', texts[fix[0]])
    for name, text in zip(names, texts):
      with self.subTest(patch=name):
        self.assertRegex(text, r'Subject: \[PATCH \d+/\d+\] \[FSDP\] ')
        self.assertIn('\nTest plan:\n', text)
        self.assertIn('\nFrom: A Contributor <a@example.com>\n', text)
        # each patch brings the tests of its change
        self.assertRegex(text, r'\+\+\+ b/test/test_fsdp_\w+\.py')

  def test_each_patch_runs_the_tests_it_adds(self):
    # in upstream's test/run_tests.sh, with and without functionalization
    # (the lines `--check` makes from upstream_base.json)
    series = os.path.join(ROOT, 'upstream', 'series')
    for name in sorted(os.listdir(series)):
      with open(os.path.join(series, name)) as f:
        text = f.read()
      added = re.findall(r'^diff --git a/test/(test_\w+\.py) .*\nnew file',
                         text, re.M)
      with self.subTest(patch=name):
        for test in added:
          for runner in ('run_test', 'run_test_without_functionalization'):
            self.assertIn(f'\n+  {runner} "$_TEST_DIR/{test}"\n', text)

  def test_pr_texts_figures_are_the_reports(self):
    # every table of figures in upstream/prs is made from
    # upstream/pr_figures.json (scripts/pr_figures.py)
    out = subprocess.run([
        sys.executable,
        os.path.join(ROOT, 'scripts', 'pr_figures.py'), '--check'
    ],
                         capture_output=True,
                         text=True)
    self.assertEqual(out.returncode, 0, out.stdout + out.stderr)

  def test_single_patch_is_the_series_squashed(self):
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, 'upstream.patch')
      out = run('-o', path)
      self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
      with open(path) as f:
        squashed = f.read()
    sys.path.insert(0, os.path.join(ROOT, 'scripts'))
    from upstream_base import base_commit, git, load_manifest
    diff = git('diff', '--binary', base_commit(), '--',
               *load_manifest()['upstream_paths'])

    def hunks(patch):  # (blob abbreviations depend on the repository)
      return re.sub(r'^index .*\n', '', patch, flags=re.M)

    self.assertEqual(hunks(squashed), hunks(diff))


if __name__ == '__main__':
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
