"""Quantized GEMMs with int8 activations (kernels/cpu/qdot_gemm.cpp, kernels/quant.py's
qlinear_int8act_ref): the kernel against the ref at odd shapes (T=1, odd T, N not a multiple of 32,
int8 per channel and in groups, int4 in groups of 32 and 128, bias, bf16 x) through the build's
integer dots, AVX512-VNNI or AVX2 (skipped, with the reason, on a CPU with neither) and through the
portable integer dots (every CPU); int4 at the bound of AVX2's int16 block sums (a plant that doubles
the sums and halves them after fails only it); a token's row bit for bit its batch's (the GEMV against
tiles of tokens);
the ref against qlinear_ref within the bound activation rounding allows (a planted bug fails it);
the quads layout round trip; a tiny int8 / int4 model through the step plan with int8 activations
against float activations, and the executor option's checks.

The kernel's integer part is exact (int32 dots of codes); what differs from the float64 ref is
fp32's rounding of one product per block and of the sums over blocks and groups, so the tolerance
is tests/tolerances.py's for fp32 over K/32 + K/G terms."""

from __future__ import annotations

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.kernels.gemv import gemv_cpu, prepare_qlinear_weight
from llmc.kernels.panels import quad_panels, quad_rows
from llmc.kernels.quant import (dequantize_weight, qlinear_int8act_ref, qlinear_ref, quantize_activations,
                                quantize_int4, quantize_int8)
from llmc.runtime.artifact import load_artifact
from llmc.runtime.executor import KVCacheSpec
from llmc.runtime.sampling_params import RequestError
from llmc.runtime.step_plan import StepPlanProgram
from llmc.runtime.torch_executor import TorchExecutor, TorchOptions
from tiny_models import build_hf_model, write_hf_folder
from tolerances import tolerance

pytestmark = pytest.mark.usefixtures("native_kernels_built")

# (N, K, bits, group): group None is int8's one scale per output channel; 150 outputs are 5 panels, which
# AVX2's int8 GEMV meets 3 + 2 at a time on one thread
SHAPES = [(45, 96, 8, None), (40, 192, 8, 64), (150, 96, 8, 32), (70, 256, 4, 32), (33, 256, 4, 128),
          (32, 64, 4, 32)]


def quantized(n: int, k: int, bits: int, group: int | None, seed: int = 0):
    """(codes, scales, mins or None, group size) of a random [N, K] weight."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if bits == 8:
        codes, scales = quantize_int8(w, group)
        return codes, scales, None, group or k
    return (*quantize_int4(w, group), group)


@pytest.mark.parametrize("vnni", [pytest.param(True, id="vnni"), pytest.param(False, id="portable")])
# tiles of 1, 2, 3 and 4 + 3 tokens
@pytest.mark.parametrize("tokens", [1, 2, 3, 7])
@pytest.mark.parametrize("n,k,bits,group", SHAPES)
def test_kernel_matches_the_int8_activation_ref(n, k, bits, group, tokens, vnni):
    if vnni and torch.ops.llmc.qdot_isa() == "portable":
        pytest.skip("this CPU (its -march=native build) has no AVX512-VNNI or AVX2; the portable path is tested")
    codes, scales, mins, g = quantized(n, k, bits, group)
    w = prepare_qlinear_weight(codes, scales, mins, bits=bits, group_size=g, activations="int8")
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1)) * 3
    bias = torch.randn(n)
    got = torch.ops.llmc.qdot_gemm(x, w.weight, w.scales, w.mins, n, bias, bits, g, vnni)
    exact = qlinear_int8act_ref(x.double(), codes, scales, mins, bias.double(), bits=bits)
    torch.testing.assert_close(got.double(), exact, **tolerance(torch.float32, k // 32 + k // g,
                                                                 scale=exact.abs().max().item()))


@pytest.mark.parametrize("bits,group", [(8, 32), (8, None), (4, 32)])
def test_a_tokens_row_is_its_batchs(bits, group):
    """A batch-1 GEMV (on AVX2 over several panels at once) sums each output as a tile of tokens does:
    one token's row is bit for bit that row of a 5-token call, on 1 thread and on 2."""
    codes, scales, mins, g = quantized(200, 320, bits, group)
    w = prepare_qlinear_weight(codes, scales, mins, bits=bits, group_size=g, activations="int8")
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        for team in sorted({1, min(2, threads)}):
            torch.set_num_threads(team)
            batch = gemv_cpu(x, w)
            for t in range(5):
                assert torch.equal(gemv_cpu(x[t:t + 1], w), batch[t:t + 1]), (team, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int4_dots_exact_at_the_int16_bound(sign):
    """Every nibble 15 and every activation code +-127 (x constant): AVX2's int4 sums stay int16 over a
    block, and each reaches its bound, 16 products x 15 x 127 = 30480; one product more would wrap."""
    codes, scales, mins, g = quantized(64, 256, 4, 32)
    codes = torch.full_like(codes, 0xFF)
    w = prepare_qlinear_weight(codes, scales, mins, bits=4, group_size=g, activations="int8")
    x = torch.full((3, 256), sign)
    assert quantize_activations(x)[0].abs().min() == 127
    got = gemv_cpu(x, w)
    exact = qlinear_int8act_ref(x.double(), codes, scales, mins, bits=4)
    torch.testing.assert_close(got.double(), exact, **tolerance(torch.float32, 256 // 32 + 256 // g,
                                                                 scale=exact.abs().max().item()))


def test_bf16_x_rounds_the_fp32_sum_once():
    codes, scales, mins, g = quantized(50, 128, 4, 32)
    w = prepare_qlinear_weight(codes, scales, mins, bits=4, group_size=g, activations="int8")
    x = torch.randn(5, 128).bfloat16()
    got = gemv_cpu(x, w)
    exact = qlinear_int8act_ref(x.double(), codes, scales, mins, bits=4)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, **tolerance(torch.bfloat16, 1, scale=exact.abs().max().item()))


def test_quads_give_back_the_artifacts_codes():
    for bits, group in ((8, None), (4, 32)):
        codes = quantized(37, 64, bits, group)[0]
        quads = quad_panels(codes, bits)
        assert quads.shape == (2, 64 // (4 if bits == 8 else 8), 32, 4) and quads.dtype == torch.uint8
        assert torch.equal(quad_rows(quads, torch.arange(37), bits), codes)


def activation_rounding_bound(x, codes, scales, mins, bits) -> torch.Tensor:
    """[T, N]: how far int8 activations may move qlinear: |x - d q| <= d / 2 per input, so the
    output moves by at most the sum over blocks of d_b / 2 times the block's sum of |w|."""
    _, d = quantize_activations(x)                                             # [T, B]
    w = dequantize_weight(codes, scales, mins, bits).double()                  # [N, K]
    w_blocks = w.abs().view(w.shape[0], -1, 32).sum(-1)                        # [N, B]
    return d.double() / 2 @ w_blocks.T


@pytest.mark.parametrize("n,k,bits,group", SHAPES)
def test_ref_moves_qlinear_by_at_most_the_activation_rounding(n, k, bits, group):
    codes, scales, mins, _ = quantized(n, k, bits, group)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2)).double()
    moved = (qlinear_int8act_ref(x, codes, scales, mins, bits=bits) - qlinear_ref(x, codes, scales, mins, bits=bits))
    bound = activation_rounding_bound(x, codes, scales, mins, bits)
    assert moved.abs().max() > 0 and bool((moved.abs() <= bound * (1 + 1e-9)).all())


def test_a_ref_without_the_min_term_fails_the_bound():
    """Planted bug: int4's min x the block sums dropped; the rounding bound catches it."""
    codes, scales, mins, _ = quantized(40, 128, 4, 32)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3)).double() + 1    # a mean, so the min term counts
    no_min = qlinear_int8act_ref(x, codes, scales, None, bits=4)
    moved = no_min - qlinear_ref(x, codes, scales, mins, bits=4)
    assert not bool((moved.abs() <= activation_rounding_bound(x, codes, scales, mins, 4)).all())


@pytest.fixture(scope="module")
def tiny_quantized(tmp_path_factory):
    """(recipe, dtype) -> a tiny Llama (head_dim 32, widths the plan takes) compiled in that dtype
    (float32 unless given) with that weight recipe."""
    built = {}

    def get(recipe: str, dtype: str = "float32"):
        if (recipe, dtype) not in built:
            root = tmp_path_factory.mktemp(f"{dtype}-{recipe}")
            folder = write_hf_folder(build_hf_model("llama_hd32"), root / "hf")
            config = CompileConfig(dtype=dtype, quant=QuantRecipe.parse(recipe))
            built[recipe, dtype] = load_artifact(compile_model(folder, root / "art", config))
        return built[recipe, dtype]

    return get


def executor(art, activations: str, num_blocks: int = 16, step_plans: bool = True) -> TorchExecutor:
    """A native executor over `art` with a cache of `num_blocks` blocks of 16 tokens."""
    kv = KVCacheSpec.from_graph_type(art.graphs["decode"].node_map()["kv_cache"].type, num_blocks, 16)
    return TorchExecutor(art, torch.device("cpu"), kv, TorchOptions(kernels="native", activations=activations,
                                                                    step_plans=step_plans))


@pytest.mark.parametrize("recipe", ["int8", "int4-g32"])
def test_tiny_model_step_plan_int8_activations_near_float(tiny_quantized, recipe):
    """A prefill step of 3 sequences through the step plan: int8 activations against float ones,
    logits within a relative rms bound of int8 rounding (2^-7 per GEMM input, over 2 layers' chain of
    4 GEMMs each and the head: 9 roundings), and the same greedy tokens where float's lead is clear."""
    from test_step_plan import sequences
    from llmc.runtime.model_runner import build_step_inputs
    from llmc.runtime.scheduler import Chunk

    art = tiny_quantized(recipe)
    int8, flt = executor(art, "int8"), executor(art, "float")
    assert isinstance(int8.programs["prefill"], StepPlanProgram)
    assert "int8 activations" in int8.capabilities().kernels and "float" in flt.capabilities().kernels
    seqs, blocks = sequences([5, 17, 30])
    step = build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks)
    got, want = int8.run("prefill", step), flt.run("prefill", step)
    rms = lambda t: t.double().square().mean().sqrt().item()     # noqa: E731
    assert 0 < rms(got - want) <= 9 * 2.0**-7 * rms(want)
    top2 = want.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (got - want).abs().max()
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_activations_option_is_checked():
    with pytest.raises(RequestError, match="activations 'int4' is unknown"):
        TorchOptions(activations="int4")


def test_cli_refuses_an_unknown_activations_value(tiny_family):
    """One sentence, exit 1, on a command that builds an engine and on `llmc eval`."""
    from test_bad_inputs import assert_cli_error, cli

    artifact = tiny_family("llama_gqa")[2]
    assert_cli_error(cli("generate", artifact, "hi", "--activations", "int4"), "activations 'int4' is unknown")
    assert_cli_error(cli("eval", artifact, "--against", artifact, "--activations", "fp8"),
                     "--activations 'fp8' is unknown")
