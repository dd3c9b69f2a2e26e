"""The Triton rope_kv_write template with q/k RMSNorm before the rotation (qk_norm "head": Qwen3,
Gemma 3; "all": OLMo-2) against the op record's reference; and the generated template call.

The kernel norms in fp32 and rounds the normed value and the weight's product to q's dtype, as
rmsnorm_ref does, then rotates in fp32: the expected values are the reference's norms in that
dtype followed by the fp32 reference rotation (tests/test_triton_rope_kv_write.py's tolerance).
Runs in Triton's interpreter without a GPU (conftest). eps is large (0.05) against rows of mean
square ~0.1, so a dropped eps or a norm over the wrong span fails.
"""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.ops.rope import qk_norm_ref
from llmc.kernels.quant import dequantize_kv_rows
from llmc.kernels.rope import rope_inv_freq
from llmc.kernels.rope_kv_write import rope_kv_write_ref
from llmc.kernels.triton.rope_kv_write import rope_kv_write_triton
from test_triton_rope_kv_write import DEVICE, LAYER, STEPS, THETA, make_case, rope_tolerance

HEADS, KV_HEADS, NORM_EPS = 4, 2, 0.05


def norm_weights(kind: str, d: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    widths = (d, d) if kind == "head" else (HEADS * d, KV_HEADS * d)
    return [(torch.rand(w, generator=g) + 0.5).to(dtype) for w in widths]


def expected(ref: list, norms: list, kind: str, d: int, dtype: torch.dtype):
    """(q, cache) of the reference: q and k normed in `dtype`, then the fp32 rotation."""
    qkv = ref[0] if len(ref) == 4 else torch.cat(ref[:3], dim=-1)
    q, k, v = qkv.to(dtype).split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)
    q, k = (qk_norm_ref(x, w, kind, NORM_EPS, d).float() for x, w in zip((q, k), norms))
    return rope_kv_write_ref(q, k, v.float(), *ref[-3:], layer=LAYER, num_heads=HEADS, num_kv_heads=KV_HEADS,
                             head_dim=d, theta=THETA, scaling=None)


def case(d: int, dtype: torch.dtype, packed: bool, seed: int):
    ours, ref = make_case(STEPS["mixed"], HEADS, KV_HEADS, d, dtype, packed, seed=seed)
    scaled = [x * 0.3 for x in (ours[:1] if packed else ours[:3])]        # rows of mean square ~0.1
    ours[:len(scaled)] = scaled
    ref[:len(scaled)] = [x.cpu().float() for x in scaled]
    return ours, ref


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["head", "all"])
def test_triton_norms_then_rotates_as_the_reference(kind, dtype, d, packed):
    ours, ref = case(d, dtype, packed, seed=d)
    norms = norm_weights(kind, d, dtype, seed=d)
    q_got, cache_got = rope_kv_write_triton(*ours, *[w.to(DEVICE) for w in norms], layer=LAYER, num_heads=HEADS,
                                            num_kv_heads=KV_HEADS, head_dim=d, inv_freq=rope_inv_freq(d, THETA, None)
                                            .to(DEVICE), qk_norm=kind, norm_eps=NORM_EPS)
    q_want, cache_want = expected(ref, norms, kind, d, dtype)
    torch.testing.assert_close(q_got.cpu().float(), q_want.to(dtype).float(), **rope_tolerance(dtype))
    torch.testing.assert_close(cache_got.cpu().float(), cache_want.to(dtype).float(), **rope_tolerance(dtype))
    assert cache_got[1 - LAYER].isnan().all()


@pytest.mark.parametrize("kind", ["head", "all"])
def test_triton_norms_into_an_int8_cache(kind):
    """k normed, rotated and quantized: within half a code step (and a rounding) of the reference."""
    d, dtype = 64, torch.float32
    ours, ref = case(d, dtype, True, seed=5)
    cache = torch.zeros(*ours[2].shape[:-1], d + 4, dtype=torch.int8)
    ours[2] = cache.to(DEVICE)
    norms = norm_weights(kind, d, dtype, seed=5)
    q_got, cache_got = rope_kv_write_triton(*ours, *[w.to(DEVICE) for w in norms], layer=LAYER, num_heads=HEADS,
                                            num_kv_heads=KV_HEADS, head_dim=d, inv_freq=rope_inv_freq(d, THETA, None)
                                            .to(DEVICE), qk_norm=kind, norm_eps=NORM_EPS)
    ref[2] = torch.zeros(*cache.shape[:-1], d)
    q_want, cache_want = expected(ref, norms, kind, d, dtype)
    torch.testing.assert_close(q_got.cpu(), q_want, **rope_tolerance(dtype))
    rows = cache_got.cpu()[LAYER, 0]                                       # [NB, KVH, BS, D + 4]
    written = rows[..., -4:].contiguous().view(torch.float32)[..., 0] > 0  # [NB, KVH, BS]
    scale = rows[..., -4:].contiguous().view(torch.float32)
    err = (dequantize_kv_rows(rows) - cache_want[LAYER, 0]).abs()
    assert written.sum() > 0 and (err[written] <= (scale * 0.5 + 1e-5)[written]).all()


def test_launcher_refuses_norms_of_the_wrong_width():
    ours, _ = case(64, torch.float32, True, seed=1)
    norms = [w.to(DEVICE) for w in norm_weights("head", 64, torch.float32, seed=1)]
    with pytest.raises(ValueError, match=r"q_norm must be a contiguous \[256\]"):
        rope_kv_write_triton(*ours, *norms, layer=LAYER, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=64,
                             inv_freq=rope_inv_freq(64, THETA, None).to(DEVICE), qk_norm="all", norm_eps=NORM_EPS)
    with pytest.raises(ValueError, match="then q_norm, k_norm"):
        rope_kv_write_triton(*ours, layer=LAYER, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=64,
                             inv_freq=rope_inv_freq(64, THETA, None).to(DEVICE), qk_norm="head", norm_eps=NORM_EPS)


@pytest.mark.parametrize("kind", ["head", "all"])
def test_the_generated_template_call_passes_the_norms(kind, tmp_path):
    """codegen's rope_kv_write template (compiler/codegen/templates.py) hands the norm weights,
    qk_norm and norm_eps to the launcher: its outputs are the interpreted graph's."""
    from llmc.compiler.ir import parse_graph
    from llmc.runtime.torch_backend import interpret
    from test_codegen_kernels import run_generated
    from test_rope_qk_norm import plan_graph

    graph = parse_graph(plan_graph(kind, 64, "f32").replace("num_heads=4", f"num_heads={HEADS}"))
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * 64, generator=g) * 0.3
    feeds = {"qkv": qkv, "positions": torch.arange(5) * 7, "slot_mapping": torch.tensor([3, 9, -1, 17, 40]),
             "kv_cache": torch.zeros(2, 2, 4, KV_HEADS, 16, 64)}
    weights = dict(zip(("q_norm", "k_norm"), norm_weights(kind, 64, torch.float32, seed=2)))
    cache_want = feeds["kv_cache"].clone()
    want = interpret(graph, weights, {**feeds, "kv_cache": cache_want})
    (q_got,), lowering = run_generated(graph, weights, feeds, tmp_path)
    assert f"qk_norm='{kind}', norm_eps=0.05" in "".join(lowering.modules.values())
    torch.testing.assert_close(q_got, want[0], **rope_tolerance(torch.float32))
    torch.testing.assert_close(feeds["kv_cache"], cache_want, **rope_tolerance(torch.float32))
    assert cache_want.abs().sum() > 0
