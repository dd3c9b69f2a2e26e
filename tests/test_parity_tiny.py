"""Compiled artifacts of tiny random models compute what transformers computes (fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmc.compiler.driver import compile_model
from llmc.models import blocks, families
from llmc.runtime.artifact import load_artifact
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.model_runner import ModelRunner, build_step_inputs
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk
from llmc.runtime.sequence import Sequence
from tiny_models import FAMILIES, NATIVE_PLANS, build_hf_model, write_hf_folder
from tolerances import tolerance

PROMPT_LENS = (7, 1, 13)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def make_prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in PROMPT_LENS]


def new_runner(artifact_path, kernels="reference", step_plans=True):
    """Reference kernels on blocks of 4 tokens; native ones on the blocks of 16 they take."""
    art = load_artifact(artifact_path)
    num_blocks, block_size = (32, 4) if kernels == "reference" else (8, 16)
    options = {"kernels": kernels, "step_plans": step_plans, "activations": "float"}   # transformers' float math
    runner = ModelRunner.for_backend(art, num_blocks, block_size, "torch", options)
    return runner, BlockManager(num_blocks, block_size)


def run_all_positions(runner, blocks, chunks):
    """Prefill logits at every computed position (not only the last of each chunk)."""
    step = build_step_inputs([Chunk(*c) for c in chunks], blocks)
    step = dataclasses.replace(step, logits_indices=torch.arange(step.input_ids.numel()))
    return runner.run("prefill", step)


@pytest.mark.parametrize("kernels", ["reference", "native"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_decode_match_transformers(tiny_family, family, kernels):
    model, _, artifact = tiny_family(family)
    assert_matches_transformers(model, artifact, kernels, family)


def assert_whole_plans(runner, family: str, kernels: str) -> None:
    """The families shaped for the native kernels run both graphs as one step plan each, no op by op."""
    if kernels == "native" and family in NATIVE_PLANS:
        runs = runner.capabilities.graphs
        assert all(run.plan for run in runs), f"{family}: {[(r.entry, r.why) for r in runs if not r.plan]}"


def assert_matches_transformers(model, artifact, kernels: str, family: str = "") -> None:
    """Prefill logits at every position of three prompts, then 16 teacher-forced decode steps."""
    runner, blocks = new_runner(artifact, kernels)
    assert_whole_plans(runner, family, kernels)
    tol = tolerance(torch.float32, model.config.intermediate_size, scale=4.0)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=16)) for i, p in enumerate(make_prompts(1))]
    for s in seqs:
        blocks.allocate(s.seq_id, s.prompt_ids)
        blocks.append(s.seq_id, s.num_tokens + 16)
    got = run_all_positions(runner, blocks, [(s, 0, s.num_tokens) for s in seqs])
    want = torch.cat([hf_logits(model, s.prompt_ids) for s in seqs])
    torch.testing.assert_close(got, want, **tol)
    for s in seqs:
        s.num_computed = s.num_tokens
    g = torch.Generator().manual_seed(2)
    for _ in range(16):  # teacher-forced decode: feed random tokens, compare next-token logits
        for s in seqs:
            s.output_ids.append(int(torch.randint(3, 300, (), generator=g)))
        step = build_step_inputs([Chunk(s, s.num_computed, s.num_tokens) for s in seqs], blocks)
        got = runner.run("decode", step)
        want = torch.stack([hf_logits(model, s.all_ids)[-1] for s in seqs])
        torch.testing.assert_close(got, want, **tol)
        for s in seqs:
            s.num_computed = s.num_tokens


@pytest.mark.parametrize("kernels", ["reference", "native"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_over_cached_context_matches_transformers(tiny_family, family, kernels):
    """A prompt computed in three chunks, mixed with another sequence's decode token."""
    model, _, artifact = tiny_family(family)
    runner, blocks = new_runner(artifact, kernels)
    assert_whole_plans(runner, family, kernels)
    tol = tolerance(torch.float32, model.config.intermediate_size, scale=4.0)
    long = Sequence(0, make_prompts(3)[2] * 2, SamplingParams(max_tokens=1))    # 26 tokens
    short = Sequence(1, make_prompts(4)[0], SamplingParams(max_tokens=8))
    for s in (long, short):
        blocks.allocate(s.seq_id, s.prompt_ids)
        blocks.append(s.seq_id, s.num_tokens + 8)
    run_all_positions(runner, blocks, [(short, 0, short.num_tokens)])
    short.output_ids.append(5)
    pieces = []
    for start, end in ((0, 10), (10, 11), (11, 26)):
        logits = run_all_positions(runner, blocks, [(long, start, end), (short, short.num_tokens - 1, short.num_tokens)])
        pieces.append(logits[: end - start])
        torch.testing.assert_close(logits[-1], hf_logits(model, short.all_ids)[-1], **tol)
        short.output_ids.append(7)
    torch.testing.assert_close(torch.cat(pieces), hf_logits(model, long.prompt_ids), **tol)


def test_native_runner_runs_the_native_kernels_where_shapes_fit(tiny_family):
    """On the hd32 model every native kernel applies (the others fall back to refs); op by op, the
    profiler sees each (by default both graphs run as step plans, tests/test_step_plan.py)."""
    _, _, artifact = tiny_family("llama_hd32")
    runner, blocks = new_runner(artifact, "native", step_plans=False)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=1)) for i, p in enumerate(make_prompts(5))]
    for s in seqs:
        blocks.allocate(s.seq_id, s.prompt_ids)
    with torch.profiler.profile() as prof:
        run_all_positions(runner, blocks, [(s, 0, s.num_tokens) for s in seqs])
    ran = {e.name for e in prof.events()}
    assert {"llmc::paged_attention", "llmc::rope_kv_write", "llmc::run_generated",    # norms, silu_mul: generated
            "llmc::panel_gemm"} <= ran                   # 21 tokens
    assert not {"mkldnn::_linear_pointwise", "aten::linear"} & ran          # no GEMM outside the panels
    with torch.profiler.profile() as prof:
        run_all_positions(runner, blocks, [(seqs[1], 0, seqs[1].num_tokens)])   # one token: the same kernel
    assert "llmc::panel_gemm" in {e.name for e in prof.events()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_models_attend_far_from_uniformly(family):
    """Scores span several units (tiny_models.QK_GAIN): each layer's attention rows have well
    under the entropy of uniform attention over the same causal prefix, so a RoPE or scale bug
    moves the logits."""
    model = build_hf_model(family)          # a fresh copy: eager attention returns the weights
    model.config._attn_implementation = "eager"
    ids = torch.tensor([make_prompts(6)[2] * 3])                             # 39 tokens
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions          # per layer [1, H, T, T]
    uniform = torch.log(torch.arange(1, ids.shape[1] + 1, dtype=torch.float64))[1:].mean()
    for probs in attentions:
        p = probs[0, :, 1:].double()                                         # rows with > 1 key
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).mean()
        assert entropy < 0.7 * uniform, f"{family}: entropy {entropy:.2f} vs uniform {uniform:.2f}"


def test_a_rope_theta_bug_in_the_model_definition_fails_parity(tiny_family, tmp_path, monkeypatch):
    """The parity test can fail: llmc's decoder layer with RoPE theta 1% off is caught."""
    model, folder, _ = tiny_family("llama_gqa")
    build_layer = blocks.DecoderLayer.__init__

    def theta_off_by_1_percent(self, cfg, *args, **kwargs):
        build_layer(self, dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 1.01), *args, **kwargs)

    monkeypatch.setattr(blocks.DecoderLayer, "__init__", theta_off_by_1_percent)
    broken = compile_model(folder, tmp_path / "broken")
    monkeypatch.undo()
    assert_matches_transformers(model, compile_model(folder, tmp_path / "fixed"), "reference")
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_matches_transformers(model, broken, "reference")


CONFIG_BUGS = {   # name -> (family, the ModelConfig fields a buggy definition would use)
    "embedding scale dropped": ("gemma3", lambda c: dict(embed_scale=False)),
    "window off by one": ("gemma3", lambda c: dict(sliding_window=c.sliding_window + 1)),
    "attention soft-cap off": ("gemma2", lambda c: dict(attn_softcap=None)),
    "final soft-cap off": ("gemma2", lambda c: dict(final_softcap=None)),
}


@pytest.mark.parametrize("bug", list(CONFIG_BUGS))
def test_a_family_bug_in_the_model_definition_fails_parity(tiny_family, tmp_path, monkeypatch, bug):
    """Each Gemma feature is seen by the parity test: a model definition that drops it fails."""
    family, change = CONFIG_BUGS[bug]
    model, folder, artifact = tiny_family(family)
    build_model = blocks.CausalLM.__init__

    def buggy(self, cfg, *args, **kwargs):
        build_model(self, dataclasses.replace(cfg, **change(cfg)), *args, **kwargs)

    monkeypatch.setattr(blocks.CausalLM, "__init__", buggy)
    broken = compile_model(folder, tmp_path / "broken")
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_matches_transformers(model, broken, "reference")


def test_gemmas_norm_offset_dropped_fails_parity(tiny_family, tmp_path, monkeypatch):
    """Reading Gemma's norm weights as the multiplier itself (no 1 + w) is caught."""
    model, folder, _ = tiny_family("gemma3")
    monkeypatch.setitem(families.FAMILIES, "gemma3", dataclasses.replace(families.FAMILIES["gemma3"], hf_norm_offset=0.0))
    broken = compile_model(folder, tmp_path / "broken")
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_matches_transformers(model, broken, "reference")


def test_phi3_longrope_uses_the_long_factors_for_every_token_of_a_longer_serving_context(tmp_path):
    """A Phi-3 served past original_max_position_embeddings (16 of 256) rotates every token with the
    long factors (compiler/ops/rope.py longrope_choice): it equals transformers wherever transformers
    uses them too, a sequence longer than 16 in one call, prefill and decode past the switch; on a
    short prompt, where transformers switches back to the short factors, it differs, as stated."""
    model = build_hf_model("phi3", original_max_position_embeddings=16)
    artifact = compile_model(write_hf_folder(model, tmp_path / "hf"), tmp_path / "art")
    runner, blocks = new_runner(artifact)
    tol = tolerance(torch.float32, model.config.intermediate_size, scale=4.0)
    seven, _, thirteen = make_prompts(7)
    long, short = Sequence(0, thirteen * 2, SamplingParams(max_tokens=4)), Sequence(1, seven, SamplingParams())
    for s in (long, short):
        blocks.allocate(s.seq_id, s.prompt_ids)
        blocks.append(s.seq_id, s.num_tokens + 4)
    got = run_all_positions(runner, blocks, [(long, 0, long.num_tokens)])
    torch.testing.assert_close(got, hf_logits(model, long.prompt_ids), **tol)
    long.num_computed = long.num_tokens
    for token in (5, 6, 7):
        long.output_ids.append(token)
        step = build_step_inputs([Chunk(long, long.num_computed, long.num_tokens)], blocks)
        torch.testing.assert_close(runner.run("decode", step)[0], hf_logits(model, long.all_ids)[-1], **tol)
        long.num_computed = long.num_tokens
    got = run_all_positions(runner, blocks, [(short, 0, short.num_tokens)])
    assert (got - hf_logits(model, short.prompt_ids)).abs().max() > 10 * tol["atol"]


def test_gemma3_at_its_real_head_dim_256_matches_transformers_as_whole_step_plans(tmp_path):
    """Gemma's head_dim (256) through the native kernels' attention and RoPE + norms, as plans."""
    model = build_hf_model("gemma3", head_dim=256, query_pre_attn_scalar=256)
    artifact = compile_model(write_hf_folder(model, tmp_path / "hf"), tmp_path / "art")
    assert_matches_transformers(model, artifact, "native", "gemma3")
