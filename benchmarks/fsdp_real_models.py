"""Hugging Face transformers models for the memory report, built from small
configs with random weights (nothing is downloaded).

Each function is a ``--model`` of ``fsdp_flatten_memory.py``: it returns the
module (whose forward returns the language-modelling loss), an example batch
(4 sequences of 64 tokens) and the classes to wrap as FSDP units (the
decoder or encoder layer). Needs ``pip install ".[models]"``.

  python benchmarks/fsdp_flatten_memory.py --model fsdp_real_models:gpt2
"""

import torch
import torch.nn as nn

VOCAB = 1000
BATCH, TOKENS = 4, 64
# hidden 256, 4 heads, 4 layers (T5: 2 encoder and 2 decoder layers)
HIDDEN, HEADS, LAYERS = 256, 4, 4


class LanguageModelLoss(nn.Module):
  """Calls a transformers model with ``labels=input_ids`` and returns the
  loss (FSDP's root unit)."""

  def __init__(self, model):
    super().__init__()
    self.model = model

  def forward(self, input_ids):
    return self.model(
        input_ids=input_ids, labels=input_ids, use_cache=False).loss


def _example(model, *layer_classes):
  ids = torch.randint(
      0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(1))
  return LanguageModelLoss(model.float()), ids, set(layer_classes)


def llama(num_layers=LAYERS):
  """Llama: RMSNorm, SwiGLU MLP, no biases, rotary embeddings."""
  from transformers import LlamaConfig, LlamaForCausalLM
  from transformers.models.llama.modeling_llama import LlamaDecoderLayer
  config = LlamaConfig(
      vocab_size=VOCAB,
      hidden_size=HIDDEN,
      intermediate_size=688,
      num_hidden_layers=num_layers,
      num_attention_heads=HEADS,
      num_key_value_heads=HEADS,
      max_position_embeddings=TOKENS,
      attn_implementation='eager')
  return _example(LlamaForCausalLM(config), LlamaDecoderLayer)


def gpt2(num_layers=LAYERS):
  """GPT-2: biases everywhere, LayerNorm, tanh GELU (``gelu_new``)."""
  from transformers import GPT2Config, GPT2LMHeadModel
  from transformers.models.gpt2.modeling_gpt2 import GPT2Block
  config = GPT2Config(
      vocab_size=VOCAB,
      n_embd=HIDDEN,
      n_layer=num_layers,
      n_head=HEADS,
      n_positions=TOKENS,
      resid_pdrop=0.0,
      embd_pdrop=0.0,
      attn_pdrop=0.0,
      attn_implementation='eager')
  return _example(GPT2LMHeadModel(config), GPT2Block)


def t5(num_layers=LAYERS):
  """T5: encoder-decoder, relative position bias computed by the first
  block of each stack and passed on, gated GELU, tied embeddings."""
  from transformers import T5Config, T5ForConditionalGeneration
  from transformers.models.t5.modeling_t5 import T5Block
  config = T5Config(
      vocab_size=VOCAB,
      d_model=HIDDEN,
      d_kv=HIDDEN // HEADS,
      d_ff=688,
      num_layers=num_layers // 2,
      num_decoder_layers=num_layers // 2,
      num_heads=HEADS,
      dropout_rate=0.0,
      feed_forward_proj='gated-gelu',
      decoder_start_token_id=0,
      pad_token_id=0,
      attn_implementation='eager')
  return _example(T5ForConditionalGeneration(config), T5Block)
