"""The Triton RoPE + paged K/V write template (kernels/triton/rope_kv_write.py) against
`rope_kv_write_ref`, comparing the rotated q and the whole cache.

Without a GPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1); with
one, the same tests run on CUDA tensors. q_out and the cache are poisoned with NaN before each
launch, so a slot written that should not be (padding, another layer) or left unwritten fails.
"""

from __future__ import annotations

import pytest
import torch

from llmc.kernels.rope import rope_inv_freq
from llmc.kernels.rope_kv_write import rope_kv_write_ref
from llmc.kernels.triton.rope_kv_write import rope_kv_write_triton
from paged_layout import shuffled_block_tables
from tolerances import EPS, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
BS, LAYERS, LAYER, THETA = 16, 2, 1, 10000.0
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
SCALE = 4.0                                        # largest |value| of q, k, v (randn), about


def rope_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Kernel and fp32 ref rotate the same inputs in fp32 (two products a value): an fp32 error,
    plus the single rounding to `dtype` at the store."""
    rot = tolerance(torch.float32, 2, SCALE)
    return {"atol": rot["atol"] + EPS[dtype] * SCALE, "rtol": rot["rtol"] + EPS[dtype], "equal_nan": True}


def step(chunks: list[int], contexts: list[int], pad: list[int], g: torch.Generator):
    """positions, slot_mapping [T] and the number of cache blocks of one engine step: sequence s
    writes chunks[s] tokens after contexts[s] cached ones, through its own shuffled blocks; a
    padding token (position 0, slot -1) is inserted before each index in `pad`."""
    lens = [c + n for c, n in zip(contexts, chunks)]
    tables, _, num_blocks = shuffled_block_tables(lens, BS, g, spare=2)
    positions = [p for c, n in zip(contexts, chunks) for p in range(c, c + n)]
    slots = [tables[s][p // BS] * BS + p % BS for s, (c, n) in enumerate(zip(contexts, chunks))
             for p in range(c, c + n)]
    for at in sorted(pad, reverse=True):
        positions.insert(at, 5)
        slots.insert(at, -1)
    return torch.tensor(positions), torch.tensor(slots), num_blocks


def make_case(tokens_of: tuple, heads, kv_heads, head_dim, dtype, packed, seed=0):
    """(tensors for rope_kv_write_triton, tensors for the fp32 ref): qkv or q/k/v, positions,
    a NaN-poisoned cache and slots."""
    g = torch.Generator().manual_seed(seed)
    positions, slots, num_blocks = step(*tokens_of, g)
    qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    parts = [qkv] if packed else [x.contiguous() for x in qkv.split(widths, dim=-1)]
    index_dtype = torch.int64 if packed else torch.int32
    cache = torch.full((LAYERS, 2, num_blocks, kv_heads, BS, head_dim), float("nan"), dtype=dtype)
    ours = [*parts, positions.to(index_dtype), cache, slots.to(index_dtype)]
    ref = [*(x.float() for x in parts), positions, cache.clone().float(), slots]   # its own cache, f32 too
    return [t.to(DEVICE) for t in ours], ref


# (chunks, contexts, pad): one decode token; a prefill, a decode and a chunk after a cached
# context that crosses a block edge, with padding in the middle and at the end.
STEPS = {
    "decode1": ([1], [37], []),
    "mixed": ([5, 1, 7], [0, 20, 12], [3, 13]),
}
HEADS = [(9, 3, 64), (4, 4, 128), (8, 2, 80), (6, 1, 96)]                  # GQA, MHA, non-powers of two


def run_both(ours, ref, heads, kv_heads, head_dim, scaling, dtype, q_out=None):
    attrs = dict(layer=LAYER, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    inv_freq = rope_inv_freq(head_dim, THETA, scaling).to(DEVICE)
    q_got, cache_got = rope_kv_write_triton(*ours, **attrs, inv_freq=inv_freq, q_out=q_out)
    q_want, cache_want = rope_kv_write_ref(*ref, **attrs, theta=THETA, scaling=scaling)
    torch.testing.assert_close(q_got.cpu().float(), q_want.to(dtype).float(), **rope_tolerance(dtype))
    torch.testing.assert_close(cache_got.cpu().float(), cache_want.to(dtype).float(), **rope_tolerance(dtype))
    return q_got, cache_got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("step_name", list(STEPS))
def test_rope_kv_write_matches_ref(dtype, heads, kv_heads, head_dim, packed, step_name):
    ours, ref = make_case(STEPS[step_name], heads, kv_heads, head_dim, dtype, packed)
    q_out = torch.full_like(ours[0][:, : heads * head_dim], float("nan"), memory_format=torch.contiguous_format)
    q_got, cache_got = run_both(ours, ref, heads, kv_heads, head_dim, LLAMA3, dtype, q_out=q_out)
    assert q_got is q_out and cache_got is ours[-2]
    assert cache_got[1 - LAYER].isnan().all()                              # the other layer is untouched


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_every_scaling_rule_comes_in_through_inv_freq(scaling):
    ours, ref = make_case(STEPS["mixed"], 9, 3, 64, torch.float32, packed=True, seed=1)
    run_both(ours, ref, 9, 3, 64, scaling, torch.float32)


def test_positions_past_fp16_integers_keep_their_angles():
    """Decodes at positions 4097 and 6001 (not an fp16 integer): the angle is position * inv_freq
    in fp32, as the ref takes it."""
    ours, ref = make_case(([1, 1], [4097, 6001], []), 2, 1, 64, torch.float32, packed=True, seed=3)
    run_both(ours, ref, 2, 1, 64, None, torch.float32)


def test_q_rotated_in_place():
    ours, ref = make_case(STEPS["mixed"], 8, 2, 80, torch.float16, packed=False, seed=2)
    q_got, _ = run_both(ours, ref, 8, 2, 80, None, torch.float16, q_out=ours[0])
    assert q_got is ours[0]


def test_launcher_reads_no_values_on_the_host(monkeypatch):
    """A host sync inside CUDA-graph capture would break it: the launcher must not read a value."""
    ours, _ = make_case(STEPS["mixed"], 9, 3, 64, torch.float32, packed=True)

    def sync(*args, **kwargs):
        raise AssertionError("the launcher read a tensor's value on the host")

    inv_freq = rope_inv_freq(64, THETA, None).to(DEVICE)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    if DEVICE == "cpu":                          # the interpreter itself copies tensors to numpy
        monkeypatch.setattr("llmc.kernels.triton.rope_kv_write._rope_kv_write_kernel", NoOpKernel())
    rope_kv_write_triton(*ours, layer=LAYER, num_heads=9, num_kv_heads=3, head_dim=64, inv_freq=inv_freq)


class NoOpKernel:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _case(**overrides):
    """A valid call (T = 3, H = KVH = 2, D = 8, packed qkv) with some of its arguments replaced;
    `tensors` replaces the four positional tensors at once."""
    kw = dict(qkv=torch.zeros(3, 6 * 8), positions=torch.zeros(3, dtype=torch.long),
              cache=torch.zeros(2, 2, 4, 2, BS, 8), slots=torch.zeros(3, dtype=torch.long),
              layer=1, num_heads=2, num_kv_heads=2, head_dim=8, inv_freq=torch.zeros(4), q_out=None)
    kw.update(overrides)
    tensors = tuple(kw.pop(name) for name in ("qkv", "positions", "cache", "slots"))
    return kw.pop("tensors", tensors), kw


@pytest.mark.parametrize("overrides,words", [
    (dict(tensors=(torch.zeros(3, 48), torch.zeros(3, dtype=torch.long))), "got 2 tensors"),
    (dict(head_dim=7, qkv=torch.zeros(3, 42), cache=torch.zeros(2, 2, 4, 2, BS, 7)), "head_dim 7"),
    (dict(num_heads=3, qkv=torch.zeros(3, 56)), "num_heads 3"),
    (dict(qkv=torch.zeros(3, 48, dtype=torch.int32)), "q must be \\[T, 16\\]"),
    (dict(positions=torch.zeros(4, dtype=torch.long)), "positions must be \\[3\\]"),
    (dict(slots=torch.zeros(3)), "slot_mapping must be \\[3\\] int32/int64"),
    (dict(cache=torch.zeros(2, 2, 4, 1, BS, 8)), "kv_cache must be \\[L, 2, NB, 2, BS, 8\\]"),
    (dict(layer=2), "layer 2"),
    (dict(inv_freq=torch.zeros(4, dtype=torch.float64)), "inv_freq must be \\[4\\] float32"),
    (dict(q_out=torch.zeros(3, 16, dtype=torch.float16)), "q_out must be \\[3, 16\\] torch.float32"),
])
def test_launcher_refuses_what_the_kernel_does_not_take(overrides, words):
    tensors, kw = _case(**overrides)
    with pytest.raises(ValueError, match=words):
        rope_kv_write_triton(*tensors, **kw)


def test_separate_q_k_v_must_share_one_dtype():
    q, k, v = torch.zeros(3, 16), torch.zeros(3, 16, dtype=torch.float16), torch.zeros(3, 16)
    with pytest.raises(ValueError, match="share one dtype"):
        rope_kv_write_triton(q, k, v, torch.zeros(3, dtype=torch.long), torch.zeros(2, 2, 4, 2, BS, 8),
                             torch.zeros(3, dtype=torch.long), layer=0, num_heads=2, num_kv_heads=2, head_dim=8,
                             inv_freq=torch.zeros(4))


@pytest.mark.gpu
def test_launch_is_captured_by_a_cuda_graph():
    ours, ref = make_case(STEPS["mixed"], 9, 3, 64, torch.float16, packed=True)
    inv_freq = rope_inv_freq(64, THETA, None).to(DEVICE)
    attrs = dict(layer=LAYER, num_heads=9, num_kv_heads=3, head_dim=64, inv_freq=inv_freq)
    q_out = torch.empty_like(ours[0][:, : 9 * 64], memory_format=torch.contiguous_format)
    rope_kv_write_triton(*ours, **attrs, q_out=q_out)                       # compiles outside the capture
    ours[-2].fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_kv_write_triton(*ours, **attrs, q_out=q_out)
    graph.replay()
    q_want, cache_want = rope_kv_write_ref(*ref, layer=LAYER, num_heads=9, num_kv_heads=3, head_dim=64,
                                           theta=THETA, scaling=None)
    torch.testing.assert_close(q_out.cpu().float(), q_want.half().float(), **rope_tolerance(torch.float16))
    torch.testing.assert_close(ours[-2].cpu().float(), cache_want.half().float(), **rope_tolerance(torch.float16))
