"""The executor registry (runtime/backends.py): backends chosen by name, their options validated by
their own dataclasses and carried opaque through the engine, the KV bytes per block each tells the
engine, the capabilities it reports, and a graph that falls back to op by op said once at INFO and
shown by `llmc profile` and `llmc inspect`. A third backend registered here runs through the engine
and the CLI with no change to either."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from llmc.compiler.driver import CompileConfig, compile_model
from llmc.compiler.quant_recipe import QuantRecipe
from llmc.runtime.artifact import load_artifact
from llmc.runtime.backends import BACKENDS, backend_names, choose_backend, resolve_backend
from llmc.runtime.engine import Engine, EngineConfig, kv_cache_dtype
from llmc.runtime.executor import KVCacheSpec
from llmc.runtime.memory_plan import kv_bytes_per_token
from llmc.runtime.sampling_params import RequestError, SamplingParams
from llmc.runtime.torch_executor import TorchExecutor, TorchOptions
from tiny_models import build_hf_model, write_hf_folder

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 42, 7, 99, 3, 12]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class FakeOptions(TorchOptions):
    """The torch backend's options and one of its own, checked as any backend checks its options."""

    label: str = "plain"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.label.isidentifier():
            raise RequestError(f"label {self.label!r} must be one word")


class FakeExecutor(TorchExecutor):
    """A third backend: the torch executor under another name, whose cache blocks it says cost twice
    their bytes (a layout with padding, as far as the engine can tell)."""

    backend = "fake"
    options_type = FakeOptions
    auto_rank = -1

    @classmethod
    def auto_picks(cls, artifact, device) -> bool:
        return False

    @classmethod
    def kv_bytes_per_block(cls, kv: KVCacheSpec) -> int:
        return 2 * kv.block_bytes


@pytest.fixture
def fake_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "fake", FakeExecutor)
    return FakeExecutor


@pytest.fixture
def llmc_log(caplog):
    """Records of the 'llmc' logger at INFO, even after the CLI stopped it propagating to the root."""
    log = logging.getLogger("llmc")
    before = log.handlers, log.level, log.propagate
    log.handlers, log.propagate = [caplog.handler], False     # alone: the root's capture would record it again
    log.setLevel(logging.INFO)
    caplog.handler.setLevel(logging.INFO)
    yield caplog
    log.handlers, log.level, log.propagate = before


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """variant -> llama_hd32 (whose shapes every plan kernel takes) compiled so: 'plain' or 'kv8' (an
    int8 cache)."""
    variants = {"plain": {}, "kv8": dict(quant=QuantRecipe.parse(kv_dtype="int8"))}
    root = tmp_path_factory.mktemp("backends")
    folder = write_hf_folder(build_hf_model("llama_hd32"), root / "hf")
    cache = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = compile_model(folder, root / variant, CompileConfig(**variants[variant]))
        return cache[variant]

    return get


def greedy(engine: Engine) -> list[int]:
    return engine.generate([PROMPT], GREEDY)[0].token_ids


# ------------------------------------------------------------------------------------ registry

def test_auto_and_named_backends_resolve_through_the_registry(compiled):
    art = load_artifact(compiled("plain"))
    assert backend_names()[:3] == ("auto", "torch", "triton")
    if not torch.cuda.is_available():
        assert resolve_backend("auto", art) == ("torch", torch.device("cpu"))
    with pytest.raises(RequestError, match="backend 'warp' is unknown; choose one of auto, torch, triton"):
        resolve_backend("warp", art)
    with pytest.raises(RequestError, match="has no Triton kernels; compile it with `llmc compile --target cuda`"):
        resolve_backend("triton", art)


def test_options_are_checked_before_any_artifact_loads():
    with pytest.raises(RequestError, match="backend option 'kernals' is unknown; the backends take activations, "
                                           "cuda_graphs, kernels, step_plans"):
        EngineConfig(backend_options={"kernals": "native"})
    with pytest.raises(RequestError, match="kernels 'fast' is unknown; choose one of auto, native, reference"):
        EngineConfig(backend="triton", backend_options={"kernels": "fast"})   # another's option is still checked
    with pytest.raises(RequestError, match="step_plans='yes' must be true or false"):
        EngineConfig(backend_options={"step_plans": "yes"})
    with pytest.raises(RequestError, match="cuda_graphs=1 must be true, false or unset"):
        EngineConfig(backend_options={"cuda_graphs": 1})
    options = {"kernels": "reference"}
    config = EngineConfig(backend_options=options)
    options["kernels"] = "native"
    assert config.backend_options == {"kernels": "reference"}              # the config's own copy


def test_an_option_of_another_backend_is_ignored_with_one_info_line(compiled, fake_backend, llmc_log):
    art = load_artifact(compiled("plain"))
    choice = choose_backend("torch", art, "cpu", {"label": "x", "kernels": "reference"})
    assert choice.options == TorchOptions(kernels="reference")
    said = [r.getMessage() for r in llmc_log.records if "has no option" in r.getMessage()]
    assert said == ["the torch backend has no option label (an option of fake); ignoring it"]


# ------------------------------------------------------------------- what the executor tells

@pytest.mark.parametrize("variant", ["plain", "kv8"])
def test_the_engine_sizes_its_cache_with_the_backends_bytes_per_block(compiled, fake_backend, variant):
    path = compiled(variant)
    art = load_artifact(path)
    per_block = kv_bytes_per_token(art.config, kv_cache_dtype(art)) * 16    # int8: codes + 4 scale bytes a row
    budget = 40 * per_block + 7
    engine = Engine(path, EngineConfig(kv_cache_bytes=budget, backend_options={"kernels": "reference"}))
    cache = engine.runner.kv_cache
    assert engine.blocks.num_blocks == 40 and cache.shape[2] == 40 + 1     # + the scratch block
    assert cache[:, :, 0].numel() * cache.element_size() == per_block
    fake = Engine(path, EngineConfig(kv_cache_bytes=budget, backend="fake", backend_options={"kernels": "reference"}))
    assert fake.blocks.num_blocks == 20                                      # what the backend said a block costs


def test_capabilities_say_which_kernels_run_and_which_graphs_are_plans(compiled):
    native = Engine(compiled("plain"), EngineConfig(backend_options={"kernels": "native"})).runner.capabilities
    assert native.kernels == "native" and not native.graph_safe and not native.cuda_graphs
    assert native.plans() == ["prefill", "decode"] and native.describe_plans() == "step plans: prefill yes, decode yes"
    ref = Engine(compiled("plain"), EngineConfig(backend_options={"kernels": "reference"})).runner.capabilities
    assert ref.kernels == "reference" and ref.plans() == []
    assert ref.describe_plans() == ("step plans: none; prefill, decode op by op (step plans need the native kernels, "
                                    "these are the reference ones)")
    off = Engine(compiled("plain"), EngineConfig(backend_options={"kernels": "native", "step_plans": False}))
    assert off.runner.capabilities.describe_plans() == "step plans: none; prefill, decode op by op (step plans are off)"


# ------------------------------------------------------------------------ a third backend

def test_a_registered_backend_runs_through_the_engine_untouched(compiled, fake_backend):
    path = compiled("plain")
    want = greedy(Engine(path, EngineConfig(backend_options={"kernels": "reference"})))
    with pytest.raises(RequestError, match="label 'two words' must be one word"):
        EngineConfig(backend="fake", backend_options={"label": "two words"})
    engine = Engine(path, EngineConfig(backend="fake", backend_options={"label": "mine", "kernels": "reference"}))
    assert type(engine.runner.executor) is FakeExecutor and engine.runner.backend == "fake"
    assert engine.runner.executor.options == FakeOptions(kernels="reference", label="mine")
    assert greedy(engine) == want


def test_the_cli_selects_a_registered_backend_by_name(compiled, fake_backend):
    from typer.testing import CliRunner

    from llmc.tools.cli import app

    result = CliRunner().invoke(app, ["generate", str(compiled("plain")), "hi", "--max-tokens", "2", "--no-chat",
                                      "--backend", "fake", "--kernels", "reference"])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, ["generate", str(compiled("plain")), "hi", "--backend", "fake", "--kernels", "fast"])
    assert bad.exit_code == 1 and "kernels 'fast' is unknown" in bad.stderr and "Traceback" not in bad.stderr


def test_llmc_log_lines_after_an_in_process_invocation_reach_the_stderr_of_their_time(compiled, capsys):
    """The CLI's log handler follows sys.stderr: CliRunner closes the stderr it lent, and a later
    llmc log line (another test's engine) must not meet that closed stream ("--- Logging error ---")."""
    import logging

    from typer.testing import CliRunner

    from llmc.tools.cli import app

    assert CliRunner().invoke(app, ["inspect", str(compiled("plain"))]).exit_code == 0
    logging.getLogger("llmc").info("a line after the invocation")
    err = capsys.readouterr().err
    assert "a line after the invocation" in err and "Logging error" not in err


# -------------------------------------------------------------------------- visible fallback

@pytest.fixture
def decode_declined(monkeypatch):
    """The step plan declines the decode graph (as it declines any graph it cannot take), and only it."""
    from llmc.runtime import torch_executor
    from llmc.runtime.step_plan import NotPlannable

    lower = torch_executor.lower_step_plan

    def declining(graph, *args, **kwargs):
        if graph.name == "decode":
            raise NotPlannable("9 (gelu) has no plan kernel")
        return lower(graph, *args, **kwargs)

    monkeypatch.setattr(torch_executor, "lower_step_plan", declining)


def test_a_graph_that_cannot_be_a_plan_is_said_once_at_info_and_kept(compiled, llmc_log):
    """Blocks of 32 tokens: the plan's attention takes blocks of 16, so both graphs run op by op."""
    config = EngineConfig(block_size=32, backend_options={"kernels": "native"})
    engine = Engine(compiled("plain"), config)
    said = [r for r in llmc_log.records if "runs op by op" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO, logging.INFO]
    for record, entry in zip(said, ("prefill", "decode")):
        assert record.getMessage().startswith(f"graph {entry} runs op by op, not as one step plan: ")
        assert "blocks of 16" in record.getMessage()
    capabilities = engine.runner.capabilities
    assert capabilities.plans() == [] and all("blocks of 16" in g.why for g in capabilities.graphs)
    assert "op by op (" in capabilities.describe_plans()
    reference = EngineConfig(block_size=32, backend_options={"kernels": "reference"})
    assert greedy(engine) == greedy(Engine(compiled("plain"), reference))


def test_profile_prints_which_graphs_run_op_by_op_and_why(compiled, decode_declined):
    from typer.testing import CliRunner

    from llmc.tools.cli import app

    result = CliRunner().invoke(app, ["profile", str(compiled("plain")), "--decode-tokens", "2", "--prompt-len", "16",
                                      "--kernels", "native"])
    assert result.exit_code == 0, result.output
    head = result.stdout.splitlines()[0]
    assert head.endswith("native kernels | step plans: prefill yes, decode op by op (9 (gelu) has no plan kernel)")
    assert result.stderr.count("graph decode runs op by op") == 1 and "graph prefill" not in result.stderr


def test_inspect_says_how_the_torch_backend_runs_each_graph(compiled, monkeypatch, tmp_path):
    from llmc.tools import inspect

    line = "torch      on this CPU, native kernels: step plans: prefill yes, decode yes"
    assert line in inspect.artifact_summary(compiled("plain")).splitlines()
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path))                   # nothing built there
    monkeypatch.setattr(inspect, "native_kernels_loaded", lambda: False)
    assert "step plans unknown (native kernels not built" in inspect.artifact_summary(compiled("plain"))


def test_inspect_says_why_a_graph_runs_op_by_op(compiled, decode_declined):
    from llmc.tools import inspect

    line = "torch      on this CPU, native kernels: step plans: prefill yes, decode op by op (9 (gelu) has no plan "
    assert line + "kernel)" in inspect.artifact_summary(compiled("plain")).splitlines()
