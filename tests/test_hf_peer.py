"""The transformers peer of the benchmarks: its best path is found by trying, its tokens are
counted, and its time per token is taken at the same boundaries as llmc's."""

from __future__ import annotations

import pytest
import torch

from llmc.tools.bench import BenchRequest
from llmc.tools.bench_hf import dense_gguf_kwargs, run_hf_static
from llmc.tools.hf_paths import HfPath, TokenClock, tune


class ShortGenerate:
    """A stand-in model whose generate returns `short` fewer new tokens than asked."""
    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self, short: int):
        self.short = short

    def set_attn_implementation(self, name):
        pass

    def generate(self, ids, max_new_tokens, **kwargs):
        return torch.zeros(ids.shape[0], ids.shape[1] + max_new_tokens - self.short, dtype=torch.long)


def test_the_static_baseline_counts_the_tokens_generate_returned():
    requests = [BenchRequest([5] * n, m, 0.0) for n, m in [(3, 4), (7, 9), (2, 9)]]
    assert run_hf_static(ShortGenerate(0), requests, lambda n: None, HfPath(batch_size=2))["output_tokens"] == 22
    # 2 short per batch: batch one's longest (9) gets 7, its 4-token request still its 4; batch two 7
    assert run_hf_static(ShortGenerate(2), requests, lambda n: None, HfPath(batch_size=2))["output_tokens"] == 18


def test_tuning_keeps_the_fastest_batch_size_then_the_variations_that_helped_together():
    cost = {"batch": {16: 3.0, 32: 2.0, 64: 2.5}}

    def seconds(path: HfPath) -> float:
        if path.compile:
            raise RuntimeError("inductor is not here")
        return (cost["batch"][path.batch_size] - 0.5 * (path.attn == "eager") - 0.3 * (path.cache == "static")
                + 0.2 * path.autocast)

    best, tries = tune(torch.float32, [16, 32, 64], seconds, compile=True)
    assert best == HfPath(batch_size=32, attn="eager", cache="static")
    labels = [t["path"] for t in tries]
    assert len(labels) == len(set(labels))                                  # each path timed once
    assert "batch 32, sdpa, dynamic cache, bf16 autocast" in labels           # tried and dropped
    assert any("error" in t and "torch.compile" in t["path"] for t in tries)  # a failing path is reported
    best, _ = tune(torch.bfloat16, [64], lambda p: 1.0 + (p.attn == "eager"))
    assert best == HfPath(batch_size=64)                                     # nothing helped: the plain path


def test_a_compiled_path_needs_the_static_cache():
    with pytest.raises(ValueError, match="static cache"):
        HfPath(compile=True)


def test_the_token_clock_skips_the_prompt_and_spans_first_to_last_token():
    clock = TokenClock()
    clock.put("prompt")
    assert clock.stamps == []
    for _ in range(3):
        clock.put("token")
    clock.stamps = [10.0, 10.5, 11.0]
    assert clock.seconds_per_token() == pytest.approx(0.5)


def test_a_gguf_peer_or_reference_is_asked_for_dense_weights():
    """transformers from 5.2x keeps a GGUF's blocks packed where Hugging Face's `kernels` is installed;
    the peer and the references ask for every tensor dequantized wherever the version can be asked."""
    transformers = pytest.importorskip("transformers")
    kwargs = dense_gguf_kwargs("model.gguf")
    assert kwargs["gguf_file"] == "model.gguf"
    if hasattr(transformers, "GgufConfig"):
        assert kwargs["quantization_config"].dequantize is True
    else:
        assert "quantization_config" not in kwargs
