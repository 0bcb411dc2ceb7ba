"""Hugging Face transformers models for the memory reports, built from
configs with random weights (nothing is downloaded).

Each function is a ``--model`` of ``fsdp_flatten_memory.py``: it returns the
module (whose forward returns the language-modelling loss), an example batch
and the classes to wrap as FSDP units (the decoder or encoder layer). The
XLA:CPU report uses ``SMALL`` models; ``fsdp_compiler_memory.py`` uses
``LARGE`` ones, wide enough that the TPU compiler keeps their buffers in HBM.
Needs ``pip install ".[models]"``.

  python benchmarks/fsdp_flatten_memory.py --model fsdp_real_models:gpt2
"""

import collections

import torch
import torch.nn as nn

# ``ffn``: the feed-forward width of Llama, Qwen2 and T5 (Llama's 8/3 of
# ``hidden``, rounded up; GPT-2 and BERT use 4 times ``hidden``). ``tied``:
# whether the output embedding is the input one (None: the model's
# default). T5 has ``layers // 2`` encoder and decoder layers.
Size = collections.namedtuple(
    'Size', 'hidden heads layers vocab ffn batch tokens tied')
SMALL = Size(
    hidden=256,
    heads=4,
    layers=4,
    vocab=1000,
    ffn=688,
    batch=4,
    tokens=64,
    tied=None)
# Untied embeddings (as Llama's and Qwen2's defaults) make the root unit
# (embeddings and head) the largest.
LARGE = Size(
    hidden=1024,
    heads=16,
    layers=4,
    vocab=8000,
    ffn=2816,
    batch=4,
    tokens=128,
    tied=False)


class LanguageModelLoss(nn.Module):
  """Calls a transformers model with ``labels=input_ids`` and returns the
  loss (FSDP's root unit)."""

  def __init__(self, model):
    super().__init__()
    self.model = model

  def forward(self, input_ids):
    return self.model(
        input_ids=input_ids, labels=input_ids, use_cache=False).loss


def _common(size):
  common = dict(vocab_size=size.vocab, attn_implementation='eager')
  if size.tied is not None:
    common['tie_word_embeddings'] = size.tied
  return common


def _example(model, size, *layer_classes):
  ids = torch.randint(
      0,
      size.vocab, (size.batch, size.tokens),
      generator=torch.Generator().manual_seed(1))
  return LanguageModelLoss(model.float()), ids, set(layer_classes)


def llama(num_layers=None, size=SMALL):
  """Llama: RMSNorm, SwiGLU MLP, no biases, rotary embeddings."""
  from transformers import LlamaConfig, LlamaForCausalLM
  from transformers.models.llama.modeling_llama import LlamaDecoderLayer
  config = LlamaConfig(
      hidden_size=size.hidden,
      intermediate_size=size.ffn,
      num_hidden_layers=num_layers or size.layers,
      num_attention_heads=size.heads,
      num_key_value_heads=size.heads,
      max_position_embeddings=size.tokens,
      **_common(size))
  return _example(LlamaForCausalLM(config), size, LlamaDecoderLayer)


def qwen2(num_layers=None, size=SMALL):
  """Qwen2: Llama's layers with biased query, key and value projections and
  grouped-query attention (a quarter of the heads for keys and values)."""
  from transformers import Qwen2Config, Qwen2ForCausalLM
  from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
  config = Qwen2Config(
      hidden_size=size.hidden,
      intermediate_size=size.ffn,
      num_hidden_layers=num_layers or size.layers,
      num_attention_heads=size.heads,
      num_key_value_heads=size.heads // 4,
      max_position_embeddings=size.tokens,
      **_common(size))
  return _example(Qwen2ForCausalLM(config), size, Qwen2DecoderLayer)


def gpt2(num_layers=None, size=SMALL):
  """GPT-2: biases everywhere, LayerNorm, tanh GELU (``gelu_new``)."""
  from transformers import GPT2Config, GPT2LMHeadModel
  from transformers.models.gpt2.modeling_gpt2 import GPT2Block
  config = GPT2Config(
      n_embd=size.hidden,
      n_layer=num_layers or size.layers,
      n_head=size.heads,
      n_positions=size.tokens,
      resid_pdrop=0.0,
      embd_pdrop=0.0,
      attn_pdrop=0.0,
      **_common(size))
  return _example(GPT2LMHeadModel(config), size, GPT2Block)


def bert(num_layers=None, size=SMALL):
  """BERT (masked language modelling): post-LayerNorm encoder layers, GELU,
  biases."""
  from transformers import BertConfig, BertForMaskedLM
  from transformers.models.bert.modeling_bert import BertLayer
  config = BertConfig(
      hidden_size=size.hidden,
      num_hidden_layers=num_layers or size.layers,
      num_attention_heads=size.heads,
      intermediate_size=4 * size.hidden,
      max_position_embeddings=size.tokens,
      hidden_dropout_prob=0.0,
      attention_probs_dropout_prob=0.0,
      **_common(size))
  return _example(BertForMaskedLM(config), size, BertLayer)


def t5(num_layers=None, size=SMALL):
  """T5: encoder-decoder, relative position bias computed by the first
  block of each stack and passed on, gated GELU."""
  from transformers import T5Config, T5ForConditionalGeneration
  from transformers.models.t5.modeling_t5 import T5Block
  layers = num_layers or size.layers
  config = T5Config(
      d_model=size.hidden,
      d_kv=size.hidden // size.heads,
      d_ff=size.ffn,
      num_layers=layers // 2,
      num_decoder_layers=layers // 2,
      num_heads=size.heads,
      dropout_rate=0.0,
      feed_forward_proj='gated-gelu',
      decoder_start_token_id=0,
      pad_token_id=0,
      **_common(size))
  model = T5ForConditionalGeneration(config)
  if size.tied is False and model.lm_head.weight is model.shared.weight:
    # transformers 5 always ties T5's head to its embeddings (4.x honoured
    # tie_word_embeddings=False; with it, neither scales the decoder output)
    model.lm_head.weight = nn.Parameter(model.shared.weight.detach().clone())
  return _example(model, size, T5Block)
