"""Triton paged attention kernels against their torch refs, in Triton's interpreter on a CPU
(conftest sets TRITON_INTERPRET=1), or on a GPU where there is one.

Caches are poisoned: every slot no sequence owns (the other layer, spare blocks, the tail of a
sequence's last block) holds NaN, and block table entries past a sequence's blocks point at a
NaN block, so a kernel that reads what it must not turns the output NaN. The refs multiply
masked probabilities by those values, so they run on the same cache with the NaN zeroed.
Outputs are preallocated full of NaN, so an element the kernel never writes fails too.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from llmc.kernels.attention import kv_write_ref, paged_attention_ref, paged_decode_attention_ref
from llmc.kernels.triton.paged_decode_attention import decode_splits, paged_decode_attention_triton
from llmc.kernels.triton.paged_prefill_attention import paged_prefill_attention_triton
from paged_layout import shuffled_block_tables
from tolerances import tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's bf16 tl.dot is silently wrong, so bf16 runs on a GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
HEAD_SHAPES = [(6, 2, 80), (4, 4, 64), (8, 1, 128)]   # (H, KVH, D): groups of 3, 1 and 8; D not a power of 2
LAYER = 1


def poisoned_cache(lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-layer cache holding random K/V of each sequence at layer 1 in shuffled blocks, NaN
    everywhere else; the block table's padding entries name a NaN block."""
    g = torch.Generator().manual_seed(seed)
    tables, block_tables, num_blocks = shuffled_block_tables(lens, block_size, g, spare=3)
    nan_block = min(set(range(num_blocks)) - {b for t in tables for b in t})
    for s, table in enumerate(tables):
        block_tables[s, len(table):] = nan_block
    cache = torch.full((2, 2, num_blocks, kv_heads, block_size, head_dim), float("nan"), dtype=dtype)
    for s, n in enumerate(lens):
        slots = torch.tensor([tables[s][p // block_size] * block_size + p % block_size for p in range(n)],
                             dtype=torch.long)
        k, v = (torch.randn(n, kv_heads * head_dim, generator=g).to(dtype) for _ in range(2))
        kv_write_ref(cache, k, v, slots, layer=LAYER)
    return cache.to(DEVICE), block_tables.to(DEVICE)


def random_queries(tokens: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def nan_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def assert_attention_close(got, want, exact, dtype, context: int):
    """`got` within the dtype's tolerance of the torch ref (tests/tolerances.py, scaled by the
    context length) and no further from the float64 answer than twice the ref's own error plus a
    few output roundings: fp16's scaled tolerance alone is loose enough to hide a dropped split."""
    assert not got.isnan().any(), "NaN in the output: an unwritten element or a poisoned slot was read"
    torch.testing.assert_close(got, want, **tolerance(dtype, context))
    err_got, err_ref = ((x.double() - exact).abs().max().item() for x in (got, want))
    assert err_got <= 2 * err_ref + 2.0**-8 * exact.abs().max().item(), (err_got, err_ref)


def poison_before_windows(cache, tables, lens, chunks, window: int) -> None:
    """NaN in the K/V rows (layer LAYER) before the window of each sequence's first query: keys
    no query of the step may see, so a kernel must not read them."""
    block_size = cache.shape[4]
    for s, (n, chunk) in enumerate(zip(lens, chunks)):
        for p in range(max(0, n - chunk - window + 1)):
            cache[LAYER, :, tables[s, p // block_size], :, p % block_size] = float("nan")


def decode_case(lens, heads, kv_heads, head_dim, dtype, block_size=16, seed=0, window=0, softcap=0.0):
    """Triton output, torch ref and float64 ref of one decode step (padding rows left out of the refs)."""
    cache, tables = poisoned_cache(lens, kv_heads, head_dim, dtype, block_size, seed)
    if window:
        poison_before_windows(cache, tables, lens, [1] * len(lens), window)
    q = random_queries(len(lens), heads * head_dim, dtype, seed + 1)
    seq_lens, scale = torch.tensor(lens, dtype=torch.int32, device=DEVICE), head_dim ** -0.5
    options = dict(window=window, softcap=softcap)
    out = nan_like(q)
    got = paged_decode_attention_triton(q, cache, tables, seq_lens, LAYER, scale, out=out, **options)
    assert got is out
    live = seq_lens > 0
    clean = cache.nan_to_num(0.0)
    want = paged_decode_attention_ref(q[live], clean, tables[live], seq_lens[live], LAYER, head_dim, scale, **options)
    exact = paged_decode_attention_ref(q[live].double(), clean.double(), tables[live], seq_lens[live], LAYER,
                                       head_dim, scale, **options)
    return got, want, exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
def test_decode_over_several_splits_matches_ref(dtype, heads, kv_heads, head_dim):
    """One token, a context ending exactly at a block end, one ending mid-block, one long enough
    for several splits, and a padding row (seq_len 0) that must come out zero."""
    lens = [1, 32, 37, 0, 300]
    splits, split_len = decode_splits(len(lens), kv_heads, -(-max(lens) // 16) * 16)
    assert splits > 1 and split_len < 300 < splits * split_len
    got, want, exact = decode_case(lens, heads, kv_heads, head_dim, dtype, seed=head_dim)
    assert got[3].eq(0).all()
    assert_attention_close(got[[0, 1, 2, 4]], want, exact, dtype, max(lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,block_size", [([1], 16), ([7, 45], 16), ([19, 60], 4), ([50, 3], 64)])
def test_decode_in_one_split_matches_ref(dtype, lens, block_size):
    """T = 1 and short contexts (one split), with blocks smaller and larger than a key tile."""
    max_context = -(-max(lens) // block_size) * block_size
    assert decode_splits(len(lens), 2, max_context)[0] == 1
    got, want, exact = decode_case(lens, 6, 2, 96, dtype, block_size, seed=len(lens) + block_size)
    assert_attention_close(got, want, exact, dtype, max(lens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_in_one_split_writes_the_output_itself(dtype, monkeypatch):
    """One split: stage 1 normalises and writes out (no merge launch), a padding row comes out zero."""
    import llmc.kernels.triton.paged_decode_attention as attention

    merges = []
    launch = attention._decode_merge_kernel.__getitem__
    monkeypatch.setattr(attention, "_decode_merge_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: merges.append(grid) or launch(grid)})())
    lens = [0, 45, 3]
    assert decode_splits(len(lens), 2, 48)[0] == 1
    got, want, exact = decode_case(lens, 6, 2, 64, dtype)
    assert merges == [] and got[0].eq(0).all()
    assert_attention_close(got[[1, 2]], want, exact, dtype, max(lens))


def test_decode_splits_come_from_shapes_and_cover_the_context():
    for seqs, kv_heads, context in [(1, 1, 16), (1, 8, 4096), (256, 8, 4096), (3, 2, 304), (1, 1, 10**6)]:
        splits, split_len = decode_splits(seqs, kv_heads, context)
        assert 1 <= splits <= 16 and split_len % 32 == 0
        assert (splits - 1) * split_len < context <= splits * split_len   # none empty for the longest row
    assert decode_splits(256, 8, 4096)[0] == 1        # enough programs already: no merge needed
    assert decode_splits(1, 8, 4096)[0] > 1


def prefill_case(lens, chunks, heads, kv_heads, head_dim, dtype, block_size=16, seed=0, q_stride=0, window=0,
                 softcap=0.0):
    """Triton output, torch ref and float64 ref of one mixed step; q_stride > H * D makes q a
    slice of a wider tensor (as of a fused QKV projection's output)."""
    cache, tables = poisoned_cache(lens, kv_heads, head_dim, dtype, block_size, seed)
    if window:
        poison_before_windows(cache, tables, lens, chunks, window)
    options = dict(window=window, softcap=softcap)
    width = heads * head_dim
    q = random_queries(sum(chunks), max(q_stride, width), dtype, seed + 1)[:, :width]  # [T, H * D]
    seq_lens, scale = torch.tensor(lens, dtype=torch.int32, device=DEVICE), head_dim ** -0.5
    qsl = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    out = nan_like(q)
    got = paged_prefill_attention_triton(q, cache, tables, seq_lens, qsl, LAYER, scale, out=out, **options)
    assert got is out
    clean = cache.nan_to_num(0.0)
    want = paged_attention_ref(q, clean, tables, seq_lens, qsl, LAYER, head_dim, scale, **options)
    exact = paged_attention_ref(q.double(), clean.double(), tables, seq_lens, qsl, LAYER, head_dim, scale, **options)
    return got, want, exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
def test_mixed_step_matches_ref(dtype, heads, kv_heads, head_dim):
    """Decode tokens, a 21-token chunk over 27 cached tokens ending at a block end, a whole
    40-token prompt, a 17-token chunk ending mid-block: 81 query rows."""
    lens, chunks = [9, 48, 1, 40, 6, 33], [1, 21, 1, 40, 1, 17]
    got, want, exact = prefill_case(lens, chunks, heads, kv_heads, head_dim, dtype, seed=head_dim)
    assert_attention_close(got, want, exact, dtype, max(lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,chunks,block_size", [
    ([1], [1], 16),                  # T = 1, a first token
    ([23], [1], 16),                 # T = 1, a decode over context
    ([70, 5, 12], [70, 0, 5], 4),    # a 70-query prompt (several query blocks), a sequence with no query
    ([19, 33], [19, 2], 64),         # blocks larger than a key tile
])
def test_prefill_shapes_match_ref(dtype, lens, chunks, block_size):
    got, want, exact = prefill_case(lens, chunks, 4, 2, 64, dtype, block_size, seed=sum(lens))
    assert_attention_close(got, want, exact, dtype, max(lens))


# window 1 (itself), 16 (a block), 32 (a key tile), 50 (mid-block); a softcap that bites (scores
# here are about N(0, 1)); keys before each first query's window are NaN (poison_before_windows)
OPTIONS = [dict(window=1), dict(window=16), dict(window=32), dict(window=50), dict(softcap=0.8),
           dict(window=50, softcap=0.8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_decode_window_and_softcap_match_ref(dtype, options):
    """Windows inside one split and across several (300 keys), and a padding row (seq_len 0)."""
    lens = [1, 32, 37, 0, 300]
    got, want, exact = decode_case(lens, 6, 2, 80, dtype, seed=31, **options)
    assert got[3].eq(0).all()
    assert_attention_close(got[[0, 1, 2, 4]], want, exact, dtype, max(lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_prefill_window_and_softcap_match_ref(dtype, options):
    """A 70-query prompt (two query blocks, windows ending mid-tile), a chunk over cached context,
    decodes."""
    lens, chunks = [70, 60, 9, 40], [70, 21, 1, 1]
    got, want, exact = prefill_case(lens, chunks, 6, 2, 80, dtype, seed=32, **options)
    assert_attention_close(got, want, exact, dtype, max(lens))


@pytest.mark.parametrize("options", [{}, dict(window=40, softcap=0.8)], ids=str)
def test_head_dim_256(options):
    """Gemma's head_dim (D_PAD 256: half the query rows per prefill program)."""
    got, want, exact = decode_case([1, 45, 130], 4, 2, 256, torch.float32, seed=33, **options)
    assert_attention_close(got, want, exact, torch.float32, 130)
    got, want, exact = prefill_case([45, 70, 3], [45, 33, 1], 4, 2, 256, torch.float32, seed=34, **options)
    assert_attention_close(got, want, exact, torch.float32, 70)


def test_strided_queries_and_outputs():
    """q and out as column slices of wider tensors, as a fused QKV output would hand them over."""
    got, want, exact = prefill_case([30, 9], [13, 1], 6, 2, 80, torch.float32, seed=5, q_stride=6 * 80 + 2 * 2 * 80)
    assert_attention_close(got, want, exact, torch.float32, 30)
    cache, tables = poisoned_cache([30, 9], 2, 80, torch.float32, 16, seed=6)
    q = random_queries(2, 6 * 80 + 320, torch.float32, seed=7)[:, :480]              # [S, H * D], row stride 800
    out = torch.full((2, 600), float("nan"), device=DEVICE)[:, 100:580]
    seq_lens = torch.tensor([30, 9], dtype=torch.int32, device=DEVICE)
    paged_decode_attention_triton(q, cache, tables, seq_lens, LAYER, 0.1, out=out)
    want = paged_decode_attention_ref(q, cache.nan_to_num(0.0), tables, seq_lens, LAYER, 80, 0.1)
    torch.testing.assert_close(out, want, **tolerance(torch.float32, 30))


def test_int64_index_tensors():
    """Block tables, seq_lens and query_start_loc may be int64 (as torch builds them by default)."""
    cache, tables = poisoned_cache([30, 9], 2, 64, torch.float32, 16, seed=8)
    q = random_queries(2, 4 * 64, torch.float32, seed=9)
    seq_lens = torch.tensor([30, 9], device=DEVICE)
    want = paged_decode_attention_ref(q, cache.nan_to_num(0.0), tables, seq_lens, LAYER, 64, 0.125)
    for got in (paged_decode_attention_triton(q, cache, tables.long(), seq_lens, LAYER, 0.125, out=nan_like(q)),
                paged_prefill_attention_triton(q, cache, tables.long(), seq_lens, torch.arange(3, device=DEVICE),
                                               LAYER, 0.125, out=nan_like(q))):
        torch.testing.assert_close(got, want, **tolerance(torch.float32, 30))


def test_launchers_never_sync_with_the_device():
    """No .item(), .tolist(), int(t) or bool(t) on a tensor: the launches must be capturable in a
    CUDA graph, so every grid and split size comes from shapes."""
    args = valid_inputs()
    qsl = torch.arange(3, dtype=torch.int32, device=DEVICE)
    syncs = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def sync(*_args, **_kwargs):
        raise AssertionError("a launcher read a device value on the host")

    with mock.patch.multiple(torch.Tensor, **{name: sync for name in syncs}):
        decode = paged_decode_attention_triton(**args)
        prefill = paged_prefill_attention_triton(query_start_loc=qsl, **args)
    torch.testing.assert_close(decode, prefill, **tolerance(torch.float32, 20))   # one query each: the same


def valid_inputs():
    """Decode inputs the launchers accept: H=6, KVH=2, D=80, block size 16, two layers."""
    cache, tables = poisoned_cache([5, 20], 2, 80, torch.float32, 16, seed=0)
    return {"q": torch.zeros(2, 480, device=DEVICE), "kv_cache": cache, "block_tables": tables,
            "seq_lens": torch.tensor([5, 20], dtype=torch.int32, device=DEVICE), "layer": 1, "scale": 0.1}


REFUSALS = [
    ("q fp16, cache fp32", lambda a: {"q": a["q"].half()}, "match q's dtype"),
    ("q int", lambda a: {"q": a["q"].int()}, "int32"),
    ("q 3-D", lambda a: {"q": a["q"].view(2, 6, 80)}, r"\(2, 6, 80\)"),
    ("H not a multiple of KVH", lambda a: {"q": torch.zeros(2, 400, device=DEVICE)}, "400"),
    ("width not H * D", lambda a: {"q": torch.zeros(2, 470, device=DEVICE)}, "470"),
    ("layer past the end", lambda a: {"layer": 2}, "layer 2"),
    ("negative layer", lambda a: {"layer": -1}, "layer -1"),
    ("block size 12", lambda a: {"kv_cache": torch.zeros(2, 2, 4, 2, 12, 80, device=DEVICE)}, "got 12"),
    ("cache without the K/V axis", lambda a: {"kv_cache": a["kv_cache"][:, :1]}, r"\(2, 1,"),
    ("float block table", lambda a: {"block_tables": a["block_tables"].float()}, "float32"),
    ("block table transposed in memory", lambda a: {"block_tables": a["block_tables"].t().contiguous().t()},
     r"block_tables must be contiguous"),
    ("seq_lens strided", lambda a: {"seq_lens": torch.arange(4, dtype=torch.int32, device=DEVICE)[::2]},
     r"seq_lens must be contiguous"),
    ("one seq_len short", lambda a: {"seq_lens": a["seq_lens"][:1]}, r"\(1,\)"),
    ("int16 seq_lens", lambda a: {"seq_lens": a["seq_lens"].short()}, "int16"),
    ("out in another dtype", lambda a: {"out": a["q"].half()}, "float16"),
    ("out of another shape", lambda a: {"out": torch.zeros(3, 480, device=DEVICE)}, r"\(3, 480\)"),
    ("non-finite scale", lambda a: {"scale": float("nan")}, "nan"),
    ("cache on another device", lambda a: {"kv_cache": a["kv_cache"].to("meta")}, "meta"),
]


@pytest.mark.parametrize("what,change,words", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_launchers_refuse_what_breaks_the_contract(what, change, words):
    args = valid_inputs()
    paged_decode_attention_triton(**args)                                   # the unchanged inputs pass
    args |= change(args)
    with pytest.raises(ValueError, match=words):
        paged_decode_attention_triton(**args)
    qsl = torch.arange(args["block_tables"].shape[0] + 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=words):
        paged_prefill_attention_triton(query_start_loc=qsl, **args)


def test_launchers_refuse_a_query_count_that_does_not_fit():
    args = valid_inputs()
    with pytest.raises(ValueError, match="q has 3 rows"):
        paged_decode_attention_triton(**(args | {"q": torch.zeros(3, 480, device=DEVICE)}))
    with pytest.raises(ValueError, match=r"query_start_loc must be \[3\].*\(2,\)"):
        paged_prefill_attention_triton(query_start_loc=torch.tensor([0, 2], dtype=torch.int32, device=DEVICE),
                                       **args)
    with pytest.raises(ValueError, match="query_start_loc must be contiguous"):
        paged_prefill_attention_triton(query_start_loc=torch.arange(6, dtype=torch.int32, device=DEVICE)[::2],
                                       **args)


@pytest.mark.gpu
def test_block_offsets_past_int32_on_a_gpu():
    """Block ids whose element offset (block * KVH * BS * D) passes 2**31: int64 cache offsets."""
    num_blocks, block_size, head_dim = (2**31 // (16 * 128)) + 64, 16, 128
    cache = torch.zeros(1, 2, num_blocks, 1, block_size, head_dim, dtype=torch.float16, device="cuda")  # 8.6 GB
    blocks = [num_blocks - 1, 3, num_blocks - 40]
    assert blocks[0] * block_size * head_dim >= 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    for block in blocks:
        cache[0, :, block] = torch.randn(2, 1, block_size, head_dim, generator=g, device="cuda").half()
    tables = torch.tensor([blocks], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([40], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 2 * head_dim, generator=g, device="cuda").half()
    want = paged_decode_attention_ref(q, cache, tables, seq_lens, 0, head_dim, head_dim ** -0.5)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    for got in (paged_decode_attention_triton(q, cache, tables, seq_lens, 0, head_dim ** -0.5),
                paged_prefill_attention_triton(q, cache, tables, seq_lens, qsl, 0, head_dim ** -0.5)):
        torch.testing.assert_close(got, want, **tolerance(torch.float16, 40))


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph():
    """Captured once, replayed after the sequences grew: the split count and grids hold."""
    lens = [37, 200]
    cache, tables = poisoned_cache([300, 300], 2, 64, torch.float16, 16, seed=1)
    q = random_queries(2, 4 * 64, torch.float16, seed=2)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    paged_decode_attention_triton(q, cache, tables, seq_lens, LAYER, 0.125, out=out)      # compile outside
    graph = torch.cuda.graph_pool_handle()
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured, pool=graph):
        paged_decode_attention_triton(q, cache, tables, seq_lens, LAYER, 0.125, out=out)
    seq_lens.copy_(torch.tensor([38, 300], dtype=torch.int32))
    captured.replay()
    want = paged_decode_attention_ref(q, cache.nan_to_num(0.0), tables, seq_lens, LAYER, 64, 0.125)
    torch.testing.assert_close(out, want, **tolerance(torch.float16, 300))


TEMPLATE_GRAPH = """graph g {{
  %q = input() : f32[T,480]
  %kv_cache = input() : f32[2,2,NB,2,16,80]
  %block_tables = input() : i32[S,MB]
  %seq_lens = input() : i32[S]
{qsl}  %0 = {op}(%q, %kv_cache, %block_tables, %seq_lens{qsl_arg}, layer=1, num_heads=6, num_kv_heads=2, \
head_dim=80, scale=0.1118, window=16, softcap=0.8) : f32[T,480]
  return %0
}}
"""


@pytest.mark.parametrize("op", ["paged_attention", "paged_decode_attention"])
def test_the_template_passes_window_and_softcap(op, tmp_path):
    """compiler/codegen/templates.py writes a node's window and softcap into its launcher call."""
    import importlib.util

    from llmc.compiler.codegen import lower
    from llmc.compiler.ir import parse_graph
    from llmc.compiler.ops import OPS, Operands, verify
    decode = op == "paged_decode_attention"
    graph = parse_graph(TEMPLATE_GRAPH.format(op=op, qsl="" if decode else "  %qsl = input() : i32[S1]\n",
                                              qsl_arg="" if decode else ", %qsl"))
    verify(graph)
    (name, source), = lower({"g": graph}).modules.items()
    assert "window=16, softcap=0.8)" in source
    (tmp_path / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lens, chunks = [40, 9, 70], [1, 1, 1] if decode else [3, 1, 70]
    cache, tables = poisoned_cache(lens, 2, 80, torch.float32, 16, seed=35)
    clean = cache.nan_to_num(0.0)
    x = Operands(q=random_queries(sum(chunks), 480, torch.float32, 36), kv_cache=clean, block_tables=tables,
                 seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    if not decode:
        x["query_start_loc"] = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32,
                                            device=DEVICE)
    got, = module.build(torch.device(DEVICE))(*x.values())
    want = OPS[op].reference(x, graph.nodes[-1].attrs)               # the record's ref, with the node's attrs
    torch.testing.assert_close(got, want, **tolerance(torch.float32, 70))
