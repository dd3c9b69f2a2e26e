"""Tensor parallelism end to end on the CPU (gloo on 127.0.0.1): an artifact compiled with --tp N run by N
ranks (rank 0 in a subprocess, tests/tp_run.py; ranks 1.. its local workers) gives the greedy tokens
of the same model compiled for one rank, run here, and the same logprobs within the reduction order's
tolerance, through continuous batching, chunked prefill, preemption and the prefix cache.

Tolerance: the ranks' row-parallel GEMMs (o_proj, down_proj) each sum K / N products and the
all_reduce adds the N partial sums, where one rank sums all K in another order: fp32 rounding of the
same terms, so tests/tolerances.py's fp32 bound for the longest such reduction (the intermediate
size), at the logprobs' scale. Each run takes ~10 s (3-4 processes importing torch on 2 shared cores).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import build_hf_model, write_hf_folder
from tolerances import tolerance
from tp_run import run_requests

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TP_RUN = Path(__file__).parent / "tp_run.py"
# name -> (tiny_models family, config overrides, ranks)
MODELS = {
    "llama": ("llama_hd32", {}, 2),
    "olmo2": ("olmo2", {}, 2),                                     # q/k norm over all heads: an all_reduce inside
    "gemma3": ("gemma3", {}, 2),                                   # tied LM head split by vocabulary, sliding window
    "one_kv_head": ("llama_hd32", {"num_key_value_heads": 1}, 2),  # fewer KV heads than ranks: replicated
    "smollm2_shapes": ("llama_hd32", {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                                      "num_key_value_heads": 3}, 3),
}
BLOCKS = 9           # 4 sequences of 3-4 blocks each (one shared): the scheduler preempts


def compile_pair(tmp_path: Path, name: str) -> tuple[Path, Path, int]:
    from llmc.compiler.driver import CompileConfig, compile_model

    family, overrides, ranks = MODELS[name]
    model = build_hf_model(family, **overrides)
    folder = write_hf_folder(model, tmp_path / "hf")
    one = compile_model(folder, tmp_path / "tp1")
    return one, compile_model(folder, tmp_path / f"tp{ranks}", CompileConfig(tp=ranks)), ranks


def spec_for(artifact: Path) -> dict:
    """Four prompts sharing a 20-token prefix, chunked by a 32-token budget, in a cache of BLOCKS blocks."""
    from llmc.runtime.artifact import load_artifact

    loaded = load_artifact(artifact)
    layers, _, _, kv_heads, _, head_dim = loaded.graphs["prefill"].node_map()["kv_cache"].type.shape
    block_bytes = layers * 2 * kv_heads * 16 * head_dim * 4
    prefix = [(7 * i) % 250 + 3 for i in range(20)]
    prompts = [prefix + [(11 * i + j) % 250 + 3 for i in range(10 + 5 * j)] for j in range(4)]
    return {"engine": {"kv_cache_bytes": BLOCKS * block_bytes, "max_batched_tokens": 32, "max_num_seqs": 4,
                       "backend": "torch"}, "prompts": prompts, "max_tokens": 14, "logprobs": 5,
            "intermediate_size": loaded.config.intermediate_size}


def run_ranks(artifact: Path, ranks: int, spec: dict, tmp_path: Path) -> dict:
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / f"out{ranks}.json"
    done = subprocess.run([sys.executable, str(TP_RUN), str(artifact), str(ranks), str(tmp_path / "spec.json"),
                           str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def run_one_rank(artifact: Path, spec: dict) -> dict:
    from llmc.runtime.engine import Engine, EngineConfig

    return run_requests(Engine(artifact, EngineConfig(**spec["engine"])), spec)


def assert_same_logprobs(got: list, want: list, reduction: int) -> None:
    """Every position's top-5 logprobs: the same tokens (ties aside) with values within the tolerance."""
    for g_seq, w_seq in zip(got, want):
        assert len(g_seq) == len(w_seq)
        for g, w in zip(g_seq, w_seq):
            g_map, w_map = dict((int(t), v) for t, v in g), dict((int(t), v) for t, v in w)
            common = sorted(set(g_map) & set(w_map))
            assert len(common) >= 4, f"top tokens differ: {g} vs {w}"
            got_v, want_v = torch.tensor([g_map[t] for t in common]), torch.tensor([w_map[t] for t in common])
            torch.testing.assert_close(got_v, want_v, **tolerance(torch.float32, reduction,
                                                                  scale=max(1.0, want_v.abs().max().item())))


@pytest.mark.parametrize("name", list(MODELS))
def test_ranks_give_one_ranks_tokens_and_logprobs(tmp_path, name):
    one, sharded, ranks = compile_pair(tmp_path, name)
    spec = spec_for(one)
    want = run_one_rank(one, spec)
    got = run_ranks(sharded, ranks, spec_for(sharded), tmp_path)    # as many blocks, each smaller per rank
    assert not got["errors"] and not want["errors"]
    assert want["preemptions"] > 0 and want["prefix_cache_hit_rate"] > 0    # the scenario does what it says
    assert (got["preemptions"], got["steps"]) == (want["preemptions"], want["steps"])
    assert got["tokens"] == want["tokens"]
    assert_same_logprobs(got["logprobs"], want["logprobs"], reduction=spec["intermediate_size"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Both ranks wait until rank 0 has saved, then leave without tearing gloo down: a rank that destroyed
# its process group while the other was still saving died in teardown now and then (SIGABRT,
# "terminate called without an active exception") after its work was done.
HF_TP = """
import os, sys, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
dist.init_process_group("gloo")
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], tp_plan="auto", dtype=torch.float32)
with torch.no_grad():
    logits = model(torch.tensor([[int(t) for t in sys.argv[3].split(",")]])).logits[0]
if dist.get_rank() == 0:
    torch.save(logits.log_softmax(-1), sys.argv[2])
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_transformers_tensor_parallel_agrees_with_ours(tmp_path):
    """transformers' own tensor parallelism (tp_plan="auto", 2 gloo ranks under torchrun) is an
    independent reference: its prompt logprobs are ours at TP 2, within fp32's bound for a whole forward."""
    one, sharded, ranks = compile_pair(tmp_path, "llama")
    prompt = [3 + 7 * i % 250 for i in range(24)]
    (tmp_path / "hf_tp.py").write_text(HF_TP)
    done = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(tmp_path / "hf_tp.py"), str(tmp_path / "hf"), str(tmp_path / "hf.pt"),
                           ",".join(map(str, prompt))], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "hf.pt")                       # [T, vocab] log-softmax
    spec = spec_for(sharded) | {"prompts": [prompt], "max_tokens": 1}
    ours = run_ranks(sharded, ranks, spec, tmp_path)["logprobs"][0][:len(prompt) - 1]   # positions 1.. of the prompt
    want = [[[t, theirs[p, t].item()] for t in theirs[p].topk(5).indices.tolist()] for p in range(len(prompt) - 1)]
    assert_same_logprobs([ours], [want], reduction=spec["intermediate_size"])
