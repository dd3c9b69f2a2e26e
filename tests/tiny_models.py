"""Tiny random-weight Hugging Face models of each supported family, built in-process.

Each is written as a real Hugging Face folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML template), the same input `llmc compile` reads.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from tokenizers import AddedToken

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# name -> (transformers config class name, model class name, config overrides)
FAMILIES = {
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=6, num_key_value_heads=3)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM",
                   dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_attention_heads=6, num_key_value_heads=2, sliding_window=6)),    # every layer sliding
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False)),
    # widths a multiple of 16 and head_dim 32: the shapes llmc's native CPU kernels take
    "llama_hd32": ("LlamaConfig", "LlamaForCausalLM",
                   dict(hidden_size=128, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)),
    # The newer families, their real configs' structure scaled down: a window smaller than the test
    # prompts, a score scale that is not head_dim's, soft-caps that bite, partial rotary; widths a
    # multiple of 16 and head_dim 32, so every graph runs as one native step plan (NATIVE_PLANS).
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=4, tie_word_embeddings=True,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=128, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  original_max_position_embeddings=256,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                   "short_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0, 55.0, 89.0, 144.0],
                                   "long_factor": [2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0, 55.0, 89.0, 144.0, 233.0,
                                                   377.0]})),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM",
              dict(hidden_size=128, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM",
                    dict(num_attention_heads=6, num_key_value_heads=3,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}


# the families whose tiny models every path must run as whole step plans (tests/test_parity_tiny.py)
NATIVE_PLANS = ("llama_hd32", "qwen3", "gemma3", "gemma2", "phi3", "olmo2")


def byte_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer with no merges: 3 specials then the 256 byte symbols."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


# Q and K at the default init (std 0.02) give attention scores of ~0.03: every row is nearly
# uniform, and a RoPE or scale bug moves the logits by ~1e-3. Scaled by 10 the scores span
# several units, so attention picks tokens (tests/test_parity_tiny.py checks the entropy).
QK_GAIN = 10.0


def build_hf_model(family: str, seed: int = 0, **config):
    """A random-weight transformers model of `family`: hidden 72 unless the family (or `config`, which
    overrides it) says, 2 layers, vocab 300, random norm weights and biases, Q and K projections
    scaled by QK_GAIN."""
    import transformers

    config_cls, model_cls, overrides = FAMILIES[family]
    settings = dict(vocab_size=300, hidden_size=72, intermediate_size=120, num_hidden_layers=2,
                    max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    # a deep copy: transformers' configs change nested dicts (rope_parameters) in place, which would
    # reach back into FAMILIES and into every model built from them before
    config = getattr(transformers, config_cls)(**copy.deepcopy({**settings, **overrides, **config}))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # norms start at 1.0; make them random so a wrong norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_GAIN)
            if name.endswith("qkv_proj.weight"):                     # Phi-3's fused q, k, v: q and k rows
                p[: p.shape[0] - config.num_key_value_heads * config.hidden_size // config.num_attention_heads].mul_(QK_GAIN)
            if name.endswith(("q_norm.weight", "k_norm.weight")):   # normed q, k: the gain is in the norm
                p.uniform_(2.0, 4.0)
    return model


def write_hf_folder(model, folder: Path) -> Path:
    """Save `model` plus a byte tokenizer and ChatML template as a Hugging Face folder."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
         "add_bos_token": False}))
    return folder
