"""ModelRunner: owns the tensors. Builds attention metadata for a step and runs a graph.

The metadata is an explicit frozen value (`StepInputs`) handed to the executor, never a global:
  input_ids, positions        [T]     the tokens computed in this step, flattened
  query_start_loc             [S+1]   where each sequence's tokens start in that list
  seq_lens                    [S]     each sequence's cached length after this step
  slot_mapping                [T]     where each token's K/V go in the paged cache
  block_tables                [S, MB] each sequence's blocks, padded with 0
  logits_indices              [S]     the last token of each sequence's chunk
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.dtypes import to_torch
from llmc.compiler.ir import TensorType

from .artifact import Artifact
from .block_manager import BlockManager
from .scheduler import Chunk
from .torch_backend import OpImpl, TorchProgram


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor

    def feeds(self, kv_cache: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**self.__dict__, "kv_cache": kv_cache}


def build_step_inputs(chunks: list[Chunk], blocks: BlockManager) -> StepInputs:
    """Metadata for computing tokens [start, end) of each chunk's sequence in one step."""
    ids, positions, slots, starts, lens = [], [], [], [0], []
    for c in chunks:
        ids += c.seq.all_ids[c.start:c.end]
        positions += range(c.start, c.end)
        slots += [blocks.slot(c.seq.seq_id, p) for p in range(c.start, c.end)]
        starts.append(starts[-1] + c.end - c.start)
        lens.append(c.end)
    tables = [blocks.block_table(c.seq.seq_id) for c in chunks]
    width = max(len(t) for t in tables)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        logits_indices=torch.tensor(starts[1:], dtype=torch.int64) - 1,
    )


def allocate_kv_cache(cache_type: TensorType, num_blocks: int, block_size: int) -> torch.Tensor:
    """A zeroed cache of the layout the graphs declare, [L, 2, NB, KVH, BS, D], sized to fit."""
    layers, _, _, kv_heads, _, head_dim = cache_type.shape
    return torch.zeros(layers, 2, num_blocks, kv_heads, block_size, head_dim, dtype=to_torch(cache_type.dtype))


class ModelRunner:
    """Runs the artifact's prefill and decode graphs against one paged KV cache."""

    def __init__(self, artifact: Artifact, num_blocks: int, block_size: int, impls: dict[str, OpImpl]):
        self.artifact = artifact
        self.programs = {entry: TorchProgram(g, artifact.weights, impls) for entry, g in artifact.graphs.items()}
        cache_type = artifact.graphs["prefill"].node_map()["kv_cache"].type
        self.kv_cache = allocate_kv_cache(cache_type, num_blocks, block_size)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply copy-on-write block copies (all layers, K and V) before a step writes."""
        if copies:
            src, dst = (torch.tensor(x, dtype=torch.long) for x in zip(*copies))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def run(self, entry: str, step: StepInputs) -> torch.Tensor:
        """Logits [S, vocab] (fp32) of the last computed token of each sequence."""
        (logits,) = self.programs[entry](step.feeds(self.kv_cache))
        return logits.float()
