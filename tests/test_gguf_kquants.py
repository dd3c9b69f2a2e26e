"""GGUF K-quant (Q2_K..Q6_K) and Q5_0/Q5_1 tensors: written in-process with gguf-py, they load to
exactly the fp32 weights gguf-py's own dequantization gives for the same bytes (llmc has no kernel
for them, so they are dequantized, not kept as codes), a Llama compiled from such a file computes
bit for bit what the same weights written as F32 compute, and a type llmc does not read is one
sentence through `llmc compile`, exit 1.

gguf-py cannot quantize K-quants, so their blocks are random bytes with finite fp16 scale fields
at the offsets of llama.cpp's ggml-common.h layouts (block_q4_K etc.)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmc.compiler.driver import compile_model
from llmc.models.gguf_loader import load_gguf
from llmc.runtime.artifact import load_artifact
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.model_runner import ModelRunner, build_step_inputs
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from test_bad_inputs import assert_cli_error, cli
from test_gguf_loader import hf_to_gguf_permute, tiny_vocab, write_gguf

Q = gguf.GGMLQuantizationType
# K-quant super-blocks hold 256 weights, so every row here is 256 long (GGML_QUANT_SIZES)
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 256, 4, 2, 256
HEAD_DIM = HIDDEN // HEADS
# byte offsets of the fp16 fields (d, dmin) in one block, from ggml-common.h
FP16_FIELDS = {
    Q.Q2_K: (80, 82),   # scales[16], qs[64], d, dmin
    Q.Q3_K: (108,),     # hmask[32], qs[64], scales[12], d
    Q.Q4_K: (0, 2),     # d, dmin, scales[12], qs[128]
    Q.Q5_K: (0, 2),     # d, dmin, scales[12], qh[32], qs[128]
    Q.Q6_K: (208,),     # ql[128], qh[64], int8 scales[16], d
}
QUANTIZED_BY_GGUF_PY = (Q.Q5_0, Q.Q5_1)
TYPES = [*QUANTIZED_BY_GGUF_PY, *FP16_FIELDS]
GEMM = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def raw_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """[rows, bytes] of valid `qtype` blocks: gguf-py's quantization of random weights for Q5_0/Q5_1,
    random bytes with fp16 scales in [1e-4, 1e-3] for the K-quants."""
    if qtype in QUANTIZED_BY_GGUF_PY:
        return gguf.quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        scale = rng.uniform(1e-4, 1e-3, (rows, cols // block)).astype(np.float16)
        blocks[..., at:at + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def file_tensors(rng: np.random.Generator, qtype: Q) -> tuple[dict[str, np.ndarray], dict[str, Q]]:
    """Tensors in the file's layout (Q/K rows already permuted): GEMM weights as `qtype` blocks,
    embedding and norms F32; and the raw type of each quantized one."""
    vocab = len(tiny_vocab()[0])
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    tensors = {"token_embd.weight": rng.standard_normal((vocab, HIDDEN), dtype=np.float32),
               "output_norm.weight": np.ones(HIDDEN, np.float32)}
    raw = {}
    for n in range(LAYERS):
        tensors[f"blk.{n}.attn_norm.weight"] = np.ones(HIDDEN, np.float32)
        tensors[f"blk.{n}.ffn_norm.weight"] = np.ones(HIDDEN, np.float32)
        for part, shape in shapes.items():
            name = f"blk.{n}.{part}.weight"
            tensors[name], raw[name] = raw_blocks(rng, *shape, qtype), qtype
    return tensors, raw


def write_wide_gguf(path: Path, tensors: dict[str, np.ndarray], raw: dict[str, Q]) -> Path:
    """A 'llama' GGUF 256 wide (test_gguf_loader's are 64, too narrow for K-quants), gpt2 vocab."""
    return write_gguf(path, tensors, raw_types=raw, dims=(LAYERS, HIDDEN, HEADS, KV_HEADS, FFN))


def dequantized(tensors: dict[str, np.ndarray], raw: dict[str, Q]) -> dict[str, np.ndarray]:
    """gguf-py's own fp32 dequantization of every quantized tensor; the rest as they are."""
    return {name: gguf.quants.dequantize(t, raw[name]) if name in raw else t for name, t in tensors.items()}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_loads_to_gguf_py_dequantization(tmp_path, qtype):
    tensors, raw = file_tensors(np.random.default_rng(3), qtype)
    model = load_gguf(write_wide_gguf(tmp_path / f"{qtype.name}.gguf", tensors, raw))
    assert model.quantized == {}  # no kernel for these formats: dequantized, not kept as codes
    want = dequantized(tensors, raw)
    for n in range(LAYERS):
        for part, ours in [("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                           ("attn_output", "o_proj"), ("ffn_down", "down_proj")]:
            got = model.weights[f"layers.{n}.{ours}.weight"].numpy()
            if part in ("attn_q", "attn_k"):  # llmc undid the converter's permutation: redo it
                got = hf_to_gguf_permute(got, HEADS if part == "attn_q" else KV_HEADS)
            expect = want[f"blk.{n}.{part}.weight"]
            assert got.shape == expect.shape and np.isfinite(expect).all() and np.abs(expect).max() > 0
            np.testing.assert_array_equal(got, expect, err_msg=f"{qtype.name} {part}")


def prefill_logits(artifact: Path, prompt: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, reference kernels, fp32."""
    runner = ModelRunner.for_backend(load_artifact(artifact), 16, 4, "torch", {"kernels": "reference"})
    blocks = BlockManager(16, 4)
    seq = Sequence(0, prompt, SamplingParams(max_tokens=1))
    blocks.allocate(seq.seq_id, seq.prompt_ids)
    step = build_step_inputs([Chunk(seq, 0, seq.num_tokens)], blocks)
    step = dataclasses.replace(step, logits_indices=torch.arange(step.input_ids.numel()))
    return runner.run("prefill", step)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
def test_compiled_llama_equals_the_dequantized_weights_model(tmp_path, qtype):
    tensors, raw = file_tensors(np.random.default_rng(4), qtype)
    quant = write_wide_gguf(tmp_path / "q.gguf", tensors, raw)
    plain = write_wide_gguf(tmp_path / "f32.gguf", dequantized(tensors, raw), {})
    prompt = [5, 77, 130, 9, 200, 41, 3]
    got = prefill_logits(compile_model(quant, tmp_path / "q"), prompt)
    want = prefill_logits(compile_model(plain, tmp_path / "f32"), prompt)
    assert got.shape == (len(prompt), len(tiny_vocab()[0])) and torch.isfinite(got).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", [Q.Q8_1, Q.IQ4_NL], ids=lambda t: t.name)
def test_compile_of_an_unread_tensor_type_exits_1(tmp_path, qtype):
    """Q8_1: gguf-py cannot dequantize it; IQ4_NL: it can, but llmc does not read it (untested)."""
    tensors, raw = file_tensors(np.random.default_rng(5), Q.Q4_K)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    tensors["blk.0.ffn_up.weight"] = np.zeros((FFN, HIDDEN // block * size), np.uint8)
    raw["blk.0.ffn_up.weight"] = qtype
    path = write_wide_gguf(tmp_path / "bad.gguf", tensors, raw)
    assert_cli_error(cli("compile", path, "-o", tmp_path / "out"),
                     "'blk.0.ffn_up.weight'", f"type {qtype.name}", "Q4_K, Q5_K, Q6_K", "re-quantize")
    assert not (tmp_path / "out").exists()
