"""`llmc profile --serving`: the table holds every host phase of every side (before, sync, after) at
every point, the phases add up to the host column, the floor's bytes agree with SmolLM2-135M's shapes
counted another way, and bad options are one sentence and exit 1. No timing is asserted: the figures
are the command's output."""

from __future__ import annotations

import json

import pytest

from llmc.runtime.host_times import HOST_PHASES
from llmc.tools import profile_serving
from llmc.tools.read_floor import ReadBandwidth
from llmc.tools.serving_model import decode_floor_bytes, smollm2_135m

from test_bad_inputs import assert_cli_error, cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class SmallReadBandwidth(ReadBandwidth):
    """The read floor over one 8 MiB buffer: a fast stand-in (a cache's rate, not memory's)."""

    def __init__(self):
        super().__init__([8 * 2**20])


def test_profile_serving_prints_every_phase_of_every_side_at_every_point(tmp_path, monkeypatch):
    monkeypatch.setattr(profile_serving, "ReadBandwidth", SmallReadBandwidth)
    out = tmp_path / "serving.json"
    result = cli("profile", "--serving", "--batches", "2", "--contexts", "32,64", "--steps", "3", "--json", out)
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    assert [(p["batch"], p["context"]) for p in r["points"]] == [(2, 32), (2, 64)]
    for point in r["points"]:
        assert point["floor_bytes"] == decode_floor_bytes(smollm2_135m(), 2, point["context"])
        for side in profile_serving.SIDES:
            t = point[side]
            assert t["engine_steps"] == 3                  # the window: three whole decode steps, no prefill
            assert all(t[p] >= 0 for p in (*HOST_PHASES, "compute", "wait")) and t["compute"] > 0
            assert sum(t[p] for p in HOST_PHASES) == pytest.approx(t["host"])
            assert t["step"] > 0
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["batch", "context", "side"])
    header, *rows = lines[start:]
    assert all(name in header.split() for name in (*HOST_PHASES, "host", "compute", "step", "host/floor"))
    assert [row.split()[:3] for row in rows] == [[b, c, side] for b, c in (("2", "32"), ("2", "64"))
                                                 for side in ("before", "sync", "after")]
    assert "SmolLM2-135M" in result.stdout and "upper bound" in result.stdout


def test_floor_bytes_are_every_weight_once_a_row_per_sequence_and_every_sequences_kv():
    cfg, batch, context = smollm2_135m(), 3, 100
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    layer = h * cfg.num_heads * cfg.head_dim * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size + 2 * h
    params = cfg.vocab_size * h + cfg.num_layers * layer + h          # tied: the table is the LM head too
    assert params == 134_515_008                                      # SmolLM2-135M's published count
    kv_bytes = batch * context * cfg.num_layers * 2 * kv * 4
    assert decode_floor_bytes(cfg, batch, context) == 4 * (params + batch * h) + kv_bytes


def test_smollm2_shapes_are_the_embedded_models():
    from llmc.models.config import ModelError
    from llmc.models.embedded import embedded_model_path
    from llmc.models.gguf_loader import read_gguf_config
    try:
        path = embedded_model_path()
    except ModelError:
        pytest.skip("the embedded SmolLM2 is not installed")
    assert read_gguf_config(path) == smollm2_135m()


@pytest.mark.parametrize("args, words", [
    (["--batches", "0"], ["--batches '0'", "at least 1"]),
    (["--batches", ""], ["--batches ''", "comma-separated"]),
    (["--contexts", "128,9000"], ["context 9000", "8192"]),
    (["--contexts", "16"], ["context 16", "at least"]),
    (["--steps", "0"], ["--steps 0"]),
    (["some-artifact"], ["some-artifact", "leave the artifact out"]),
])
def test_bad_serving_options_are_one_sentence(args, words):
    assert_cli_error(cli("profile", "--serving", *args), *words)


def test_profile_without_an_artifact_or_serving_says_what_to_give():
    assert_cli_error(cli("profile"), "artifact", "--serving")


def test_contexts_leave_room_for_every_output_token():
    least = profile_serving.max_tokens(3) + profile_serving.UNIQUE_TOKENS + 1
    profile_serving.check_grid([least], 3, 8192)
    with pytest.raises(profile_serving.RequestError):
        profile_serving.check_grid([least - 1], 3, 8192)
