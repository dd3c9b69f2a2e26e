"""The self-speculative draft graph (issue 22): passes/skip_layers.py, compiler/draft.py's search, the
artifact's third entry, and the CLI around it.

The reference is independent of the pass: the transformers model itself with the skipped layers
taken out of `model.model.layers` (its config's layer count and layer types cut to match, so a
Gemma layer keeps its own sliding or full attention).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from llmc.compiler.draft import candidates, check_draft_skip, expected_accepted, interpret
from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.frontend import trace
from llmc.compiler.ops import verify
from llmc.models.config import ModelError
from llmc.models.loader import load_config
from llmc.passes.rewrite import PassContext
from llmc.passes.skip_layers import skip_layers
from llmc.runtime.artifact import load_artifact
from llmc.runtime.torch_backend import TorchProgram
from llmc.tools.cli import app
from llmc.tools.feeds import BlockLayout, Step, garbage_cache, step_feeds

from tiny_models import build_hf_model, write_hf_folder
from tolerances import tolerance

LAYERS = 4
FAMILIES = ("llama_gqa", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2")
GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]   # its tiny has 3


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """family -> (transformers model with LAYERS layers, HF folder); built once each."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            types = {"layer_types": GEMMA3_TYPES} if family == "gemma3" else {}
            model = build_hf_model(family, num_hidden_layers=LAYERS, **types)
            cache[family] = (model, write_hf_folder(model, tmp_path_factory.mktemp(family) / "hf"))
        return cache[family]

    return get


@pytest.fixture(scope="module")
def draft_artifact(tiny4, tmp_path_factory):
    """family -> artifact compiled with --draft-skip 2; built once each."""
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            out = tmp_path_factory.mktemp(family) / "artifact"
            cache[family] = compile_model(tiny4(family)[1], out, CompileConfig(draft_skip=2))
        return cache[family]

    return get


def hf_without_layers(model, skip: tuple[int, ...]):
    """The transformers model with layers `skip` removed (a deep copy; the original is untouched)."""
    cut = copy.deepcopy(model)
    kept = [i for i in range(len(cut.model.layers)) if i not in skip]
    cut.model.layers = torch.nn.ModuleList([cut.model.layers[i] for i in kept])
    cut.config.num_hidden_layers = len(kept)
    if getattr(cut.config, "layer_types", None):
        cut.config.layer_types = [cut.config.layer_types[i] for i in kept]
    return cut


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def traced_feeds(ids: list[int]) -> dict[str, torch.Tensor]:
    n = len(ids)
    return {"input_ids": torch.tensor(ids), "positions": torch.arange(n),
            "query_start_loc": torch.tensor([0, n], dtype=torch.int32), "logits_indices": torch.arange(n)}


def layer_of_weights(graph) -> set[int]:
    return {int(n.name.split(".")[2]) for n in graph.weights() if n.name.startswith("w.layers.")}


@pytest.mark.parametrize("skip", [(1,), (1, 2), (0, 3)])
@pytest.mark.parametrize("family", FAMILIES)
def test_skip_layers_matches_transformers_without_those_layers(tiny4, family, skip):
    model, folder = tiny4(family)
    traced = trace(load_config(folder), "prefill")
    ctx = PassContext(options={"draft_skip": skip})
    draft = skip_layers(traced, ctx)
    verify(draft)
    kept = tuple(i for i in range(LAYERS) if i not in skip)
    assert draft.name == "draft" and layer_of_weights(draft) == set(kept)
    assert draft.op_counts()["attention"] == len(kept)
    assert [n.name for n in draft.inputs()] == [n.name for n in traced.inputs()]
    assert ctx.options["kv_layers"] == kept and ctx.options["kv_cache_layers"] == LAYERS
    assert ctx.hits["skip_layers"] > 0
    weights = {name: p.detach() for name, p in load_hf_weights(folder).items()}
    ids = prompt(11)
    got = interpret(draft, weights, traced_feeds(ids))
    want = hf_logits(hf_without_layers(model, skip), ids)
    torch.testing.assert_close(got, want, **tolerance(torch.float32, model.config.intermediate_size, scale=4.0))
    assert not torch.allclose(got, hf_logits(model, ids), atol=1e-3)     # a skip that changes nothing tests nothing


def load_hf_weights(folder):
    from llmc.models.loader import load_model

    return load_model(folder).weights


def test_skip_of_a_layer_the_graph_lacks_is_refused(tiny4):
    from llmc.compiler.ir import IRError

    traced = trace(load_config(tiny4("olmo2")[1]), "prefill")
    with pytest.raises(IRError, match=r"draft_skip \[7\] names layers outside the graph's 4 layers"):
        skip_layers(traced, PassContext(options={"draft_skip": (7,)}))


def test_empty_skip_set_is_the_prefill_graph(tiny4):
    from llmc.compiler.ir import print_graph

    traced = trace(load_config(tiny4("olmo2")[1]), "prefill")
    draft = skip_layers(traced, PassContext(options={"draft_skip": ()}))
    assert print_graph(draft).replace("graph draft", "graph prefill") == print_graph(traced)


@pytest.mark.parametrize("family", ("llama_gqa", "gemma2", "olmo2"))
def test_compiled_draft_runs_and_matches_transformers(tiny4, draft_artifact, family):
    """The artifact's draft (after the whole pipeline: paged attention, fusions) on a garbage paged
    cache equals transformers without the layers the report names; weights are stored once."""
    model, _ = tiny4(family)
    art = load_artifact(draft_artifact(family))
    report = json.loads((art.path / "report.json").read_text())["draft"]
    skip = tuple(report["skip"])
    assert len(skip) == 2 and report["calibration_tokens"] > 0 and 0.0 <= report["agreement"] <= 1.0
    assert layer_of_weights(art.graphs["draft"]) == set(range(LAYERS)) - set(skip)
    draft_weights = {n.name[2:] for n in art.graphs["draft"].weights()}
    assert draft_weights <= set(art.weights)                                # shared, no second copy
    assert not any("draft" in name for name in art.weights)
    ids = prompt(9, seed=1)
    feeds = step_feeds(art.graphs["draft"], Step.prefill("draft", [ids]))
    (got,) = TorchProgram(art.graphs["draft"], art.weights)(feeds)
    want = hf_logits(hf_without_layers(model, skip), ids)
    torch.testing.assert_close(got, want, **tolerance(torch.float32, model.config.intermediate_size, scale=4.0))


def test_draft_writes_only_kept_layers_and_verify_overwrites_them(tiny4, draft_artifact):
    """Draft KV writes land in the kept layers' own cache slices at the drafted slots; a verify
    (prefill over the same positions) then gives exactly what it gives on a cache the draft never
    touched, so nothing the draft wrote is trusted."""
    art = load_artifact(draft_artifact("llama_gqa"))
    skip = json.loads((art.path / "report.json").read_text())["draft"]["skip"]
    context, drafted = prompt(8, seed=2), prompt(4, seed=3)
    ids = context + drafted
    step = Step.after_context("verify", [ids], [len(drafted)])
    layout = BlockLayout.shuffled([len(ids)])
    prefill, draft = (TorchProgram(art.graphs[e], art.weights) for e in ("prefill", "draft"))
    clean = garbage_cache(art.graphs["prefill"], layout)
    touched = clean.clone()
    draft(step_feeds(art.graphs["draft"], step, layout, touched))
    changed = [bool((touched[layer] != clean[layer]).any()) for layer in range(LAYERS)]
    assert changed == [layer not in skip for layer in range(LAYERS)]
    (want,) = prefill(step_feeds(art.graphs["prefill"], step, layout, clean))
    (got,) = prefill(step_feeds(art.graphs["prefill"], step, layout, touched))
    assert torch.equal(got, want)
    assert torch.equal(touched, clean)          # the verify wrote every slot the draft wrote


def test_native_executor_runs_draft_as_a_step_plan(draft_artifact):
    from llmc.runtime.model_runner import ModelRunner

    runner = ModelRunner.for_backend(load_artifact(draft_artifact("olmo2")), 8, 16, "torch", {"kernels": "native"})
    runs = {run.entry: run for run in runner.capabilities.graphs}
    assert "draft" in runs and runs["draft"].plan, runs.get("draft")


def test_search_pieces():
    agree = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    # runs from each position, capped at 4: 2 1 0 4 4 3 2 1 0 1
    assert expected_accepted(agree) == pytest.approx(18 / 10)
    assert expected_accepted(torch.ones(5, dtype=torch.bool), k=4) == pytest.approx((4 + 4 + 3 + 2 + 1) / 5)
    assert candidates(6, (), 2) == [1, 2, 3, 4]
    assert candidates(6, (2,), 2) == [1, 3, 4]
    assert candidates(4, (1, 2), 3) == [0, 3]          # N = 3 of 4 leaves no inner layer
    for n in (4, 5, -1):
        with pytest.raises(ModelError, match="--draft-skip"):
            check_draft_skip(n, 4)
    check_draft_skip(3, 4)


def run_cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_sentence_error(result) -> str:
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error:") and "Traceback" not in text and text.count(". ") == 0, text
    return text


@pytest.mark.parametrize("n", [1, 2])
def test_cli_compile_draft_skip_and_ir_graph_draft(tiny4, tmp_path, n):
    out = tmp_path / "art"
    result = run_cli("compile", tiny4("llama_gqa")[1], "-o", out, "--draft-skip", n)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())["draft"]
    assert len(report["skip"]) == n and report["num_layers"] == LAYERS and report["kept"] == LAYERS - n
    assert json.loads((out / "manifest.json").read_text())["entries"]["draft"] == "draft.ir"
    shown = run_cli("ir", out, "--graph", "draft")
    assert shown.exit_code == 0 and shown.output.startswith("graph draft {"), shown.output
    assert shown.output.count("paged_attention(") == LAYERS - n
    assert "draft      skips layers" in run_cli("inspect", out).output


@pytest.mark.parametrize("n", [LAYERS, LAYERS + 3])
def test_cli_draft_skip_of_every_layer_is_one_sentence(tiny4, tmp_path, n):
    text = one_sentence_error(run_cli("compile", tiny4("llama_gqa")[1], "-o", tmp_path / "a", "--draft-skip", n))
    assert f"--draft-skip {n}" in text and f"{LAYERS} layers" in text
    assert not (tmp_path / "a").exists()


def test_cli_ir_graph_draft_without_one_is_one_sentence(tiny_family, tiny4):
    _, folder, artifact = tiny_family("llama_gqa")
    text = one_sentence_error(run_cli("ir", artifact, "--graph", "draft"))
    assert "without a draft graph" in text and "--draft-skip" in text
    text = one_sentence_error(run_cli("ir", folder, "--graph", "draft"))
    assert "--draft-skip" in text


@pytest.mark.parametrize("idle", [1, 2])
def test_search_skips_the_layer_that_does_nothing(tmp_path, idle):
    """A layer whose attention and MLP outputs are zeroed leaves the residual stream as it was: the
    greedy search must skip exactly it, at agreement 1 and KL 0, whichever inner layer it is."""
    from llmc.compiler.draft import calibration_tokens, choose_draft_skip
    from llmc.models.loader import load_model

    model = build_hf_model("llama_gqa", num_hidden_layers=LAYERS)
    with torch.no_grad():
        model.model.layers[idle].self_attn.o_proj.weight.zero_()
        model.model.layers[idle].mlp.down_proj.weight.zero_()
    loaded = load_model(write_hf_folder(model, tmp_path / "hf"))
    tokens = calibration_tokens(loaded.tokenizer, 64)
    choice = choose_draft_skip(trace(loaded.config, "prefill"), loaded.weights, tokens, 1)
    assert choice.skip == (idle,) and choice.agreement == 1.0 and choice.mean_kl == pytest.approx(0.0, abs=1e-6)
    assert choice.expected_accepted_k4 == pytest.approx((4 * 61 + 3 + 2 + 1) / 64)
    assert choice.forwards == 1 + 1 + (LAYERS - 2) and len(choice.rounds) == 1     # target, residuals, candidates


@pytest.mark.parametrize("skipped, layer", [((), 1), ((2,), 1), ((1,), 3), ((1, 2), 0)])
def test_a_resumed_draft_scores_as_a_whole_forward(tiny4, skipped, layer):
    """The search runs a candidate from the current draft's residual entering its layer; that must
    give the whole forward's numbers (bit for bit: the same ops on the same values)."""
    from llmc.compiler.draft import Calibration
    from llmc.models.loader import load_model

    loaded = load_model(tiny4("gemma2")[1])
    calib = Calibration(trace(loaded.config, "prefill"), loaded.weights, prompt(40, seed=5))
    skip = tuple(sorted(skipped + (layer,)))
    whole_agree, whole_kl = calib.score(skip)
    agree, kl = calib.score(skip, (layer, calib.residuals(skipped)[layer]))
    assert torch.equal(agree, whole_agree) and kl == whole_kl


def draft_logits(art, backend: str, seqs) -> torch.Tensor:
    """The draft entry's logits for whole prompts `seqs` on `backend`, through the model runner."""
    from llmc.runtime.block_manager import BlockManager
    from llmc.runtime.model_runner import ModelRunner
    from llmc.runtime.scheduler import Chunk
    from llmc.runtime.step_inputs import build_step_inputs

    options = {"kernels": "reference"} if backend == "torch" else {}
    runner, blocks = ModelRunner.for_backend(art, 8, 16, backend, options), BlockManager(8, 16)
    for s in seqs:
        blocks.allocate(s.seq_id, s.prompt_ids)
    return runner.run("draft", build_step_inputs([Chunk(s, 0, s.num_tokens) for s in seqs], blocks))


def test_draft_on_the_triton_executor_matches_torch(tiny4, tmp_path):
    """--target cuda: the draft's units get generated Triton kernels like prefill's, and the triton
    executor (Triton's interpreter on a CPU) runs the draft entry as the torch one does."""
    from llmc.runtime.sampling_params import SamplingParams
    from llmc.runtime.sequence import Sequence

    model, folder = tiny4("gemma2")
    art = load_artifact(compile_model(folder, tmp_path / "cuda", CompileConfig(target="cuda", draft_skip=1)))
    assert json.loads((art.path / "report.json").read_text())["kernels"]["units"]["draft"] > 0
    seqs = [Sequence(i, prompt(n, seed=i), SamplingParams(max_tokens=1)) for i, n in enumerate((7, 3))]
    want = draft_logits(art, "torch", seqs)
    got = draft_logits(art, "triton", seqs)
    assert got.shape == (2, 300)
    torch.testing.assert_close(got, want, **tolerance(torch.float32, model.config.intermediate_size, scale=4.0))
