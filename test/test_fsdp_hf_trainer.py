"""The Hugging Face Trainer's XLA FSDP path with flatten_parameters=True.

Most users reach XlaFullyShardedDataParallel through ``transformers.Trainer``
with ``fsdp_config={"xla": True, "xla_fsdp_settings": {...}}``: it wraps
each decoder layer as a unit (with ``xla_fsdp_grad_ckpt``, a unit of
``checkpoint_module(layer)``) and the model as the root. A tiny Llama, built
from a config with random weights and trained on random tokens, is trained
for a few steps, evaluated and saved with flatten_parameters True and False;
the fixed version must give flatten_parameters=False's losses and weights.

transformers 5.x's Trainer cannot run XLA FSDP v1 (it delays the
optimizer's creation for XLA FSDP and never makes it: "'NoneType' object has
no attribute 'param_groups'" from the LR scheduler), and the ``models``
extra pins 5.x, so the training runs in a subprocess with transformers
4.57.6 and accelerate 1.10.1 from a side directory first on PYTHONPATH:
$FSDP_HF_TRAINER_DEPS, default ``.hf_trainer_deps`` in the checkout, made by
``.ci/run`` (the command is ``DEPS_COMMAND`` below). Without it the tests
skip and say how to make it. This repository's check, not part of the
upstream series.
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPS = os.environ.get('FSDP_HF_TRAINER_DEPS',
                      os.path.join(ROOT, '.hf_trainer_deps'))
# transformers 4.57.6 wants huggingface_hub < 1.0 and tokenizers <= 0.23.0
# (checked when it is imported), accelerate psutil; --no-deps keeps the
# environment's torch and torch_xla.
DEPS_COMMAND = (f'python3 -m pip install --upgrade --target {DEPS} --no-deps '
                'transformers==4.57.6 accelerate==1.10.1 '
                'huggingface_hub==0.36.2 tokenizers==0.22.2 psutil==7.2.2')

STEPS = 4
# The repository's tolerance for flatten_parameters True against False
# (test_fsdp_flatten_features.py). On CPU the losses measure equal to the
# last bit, but the saved weights differ by up to one float32 ulp: the
# Trainer clips gradients (max_grad_norm=1.0) with a norm summed over one flat
# tensor per unit instead of one per parameter, whose last bit differs
# (with max_grad_norm=0 the weights are equal too).
RTOL = 1e-6 if os.environ.get('PJRT_DEVICE', 'CPU') == 'CPU' else 1e-4
# (flatten_parameters, xla_fsdp_grad_ckpt) trained, in one process
CONFIGS = [
    (flatten, ckpt) for ckpt in (False, True) for flatten in (True, False)
]


def _name(flatten, ckpt):
  return f"flatten={flatten}{', grad_ckpt' if ckpt else ''}"


def _train(out_dir):
  """Trains every configuration of CONFIGS and writes their losses (and
  saved models) under ``out_dir``; runs with DEPS first on sys.path."""
  import torch
  import torch_xla
  import transformers
  from transformers import (LlamaConfig, LlamaForCausalLM, Trainer,
                            TrainingArguments)

  class RecordingTrainer(Trainer):
    """Keeps each step's loss tensor: the logged loss is rounded to 4
    digits."""

    def training_step(self, *args, **kwargs):
      loss = super().training_step(*args, **kwargs)
      self.step_losses.append(loss.detach())
      return loss

  config = LlamaConfig(
      vocab_size=128,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=4,
      max_position_embeddings=64)
  # Random tokens as the data set (nothing downloaded): 8 training and 4
  # evaluation sequences of 32.
  tokens = torch.randint(
      config.vocab_size, (12, 32), generator=torch.Generator().manual_seed(0))
  examples = [dict(input_ids=t, labels=t) for t in tokens]
  results = {'transformers': transformers.__version__}
  for flatten, ckpt in CONFIGS:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    output_dir = os.path.join(out_dir, _name(flatten, ckpt))
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        # (the default fused AdamW refuses XLA tensors)
        optim='adamw_torch',
        fsdp='full_shard',
        fsdp_config={
            'xla': True,
            'xla_fsdp_settings': {
                'flatten_parameters': flatten
            },
            'xla_fsdp_grad_ckpt': ckpt,
            # (a unit per LlamaDecoderLayer, the model's _no_split_modules)
        },
        save_strategy='no',
        report_to=[],
        disable_tqdm=True,
        seed=0)
    trainer = RecordingTrainer(
        model=model,
        args=args,
        train_dataset=examples[:8],
        eval_dataset=examples[8:])
    trainer.step_losses = []
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    from safetensors.torch import load_file
    saved = load_file(os.path.join(output_dir, 'model.safetensors'))
    results[_name(flatten, ckpt)] = dict(
        train=[l.item() for l in trainer.step_losses],
        eval=metrics['eval_loss'],
        output_dir=output_dir,
        unchanged=[k for k, v in saved.items() if torch.equal(v, initial[k])])
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f)


@unittest.skipUnless(
    os.path.isdir(os.path.join(DEPS, 'transformers')),
    f'needs transformers 4.57.6 in {DEPS} (its Trainer runs XLA FSDP v1, '
    f'5.x cannot): {DEPS_COMMAND}')
class TestHfTrainerXlaFsdp(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    tmp = tempfile.TemporaryDirectory()
    cls.addClassCleanup(tmp.cleanup)
    env = dict(
        os.environ,
        PJRT_DEVICE=os.environ.get('PJRT_DEVICE', 'CPU'),
        PYTHONPATH=os.pathsep.join(
            p for p in (DEPS, os.environ.get('PYTHONPATH')) if p))
    if env['PJRT_DEVICE'] == 'CPU':
      env['CPU_NUM_DEVICES'] = '1'
    run = subprocess.run(
        [sys.executable,
         os.path.abspath(__file__), '_train', tmp.name],
        env=env,
        capture_output=True,
        text=True)
    if run.returncode != 0:
      raise RuntimeError(f'training with the Trainer failed:\n'
                         f'{run.stderr[-6000:]}')
    with open(os.path.join(tmp.name, 'results.json')) as f:
      cls.results = json.load(f)

  def results_of(self, ckpt):
    return (self.results[_name(True, ckpt)], self.results[_name(False, ckpt)])

  def assert_same_losses(self, ckpt, key):
    fixed, unflattened = self.results_of(ckpt)
    torch.testing.assert_close(fixed[key], unflattened[key], rtol=RTOL, atol=0)

  def assert_same_saved_weights(self, ckpt):
    from safetensors.torch import load_file
    fixed, unflattened = (
        load_file(os.path.join(r['output_dir'], 'model.safetensors'))
        for r in self.results_of(ckpt))
    self.assertEqual(sorted(fixed), sorted(unflattened))
    for name in fixed:
      torch.testing.assert_close(
          fixed[name],
          unflattened[name],
          rtol=RTOL,
          atol=RTOL * 1e-1,
          msg=lambda m: f'{name}: {m}')

  def test_uses_the_transformers_whose_trainer_runs_xla_fsdp(self):
    self.assertEqual(self.results['transformers'], '4.57.6')

  def test_training_changes_every_weight(self):
    # (the comparisons below would also hold for a model that never trained)
    for ckpt in (False, True):
      with self.subTest(grad_ckpt=ckpt):
        self.assertEqual(self.results[_name(True, ckpt)]['unchanged'], [])

  def test_training_losses_equal_flatten_false(self):
    self.assert_same_losses(False, 'train')

  def test_training_losses_equal_flatten_false_with_grad_ckpt(self):
    self.assert_same_losses(True, 'train')

  def test_eval_loss_equals_flatten_false(self):
    self.assert_same_losses(False, 'eval')

  def test_eval_loss_equals_flatten_false_with_grad_ckpt(self):
    self.assert_same_losses(True, 'eval')

  def test_saved_model_equals_flatten_false(self):
    self.assert_same_saved_weights(False)

  def test_saved_model_equals_flatten_false_with_grad_ckpt(self):
    self.assert_same_saved_weights(True)


if __name__ == '__main__':
  if sys.argv[1:2] == ['_train']:
    _train(sys.argv[2])
    sys.exit(0)
  test = unittest.main(exit=False)
  sys.exit(0 if test.result.wasSuccessful() else 1)
