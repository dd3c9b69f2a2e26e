"""A pure-Python stand-in for the model, to drive the scheduler on plain integers.

The next token is a deterministic function of all tokens so far, as in greedy decoding, so
any scheduling (chunking, preemption, batching) must give every request the same output.
"""

from __future__ import annotations

from llmc.runtime.block_manager import BlockManager
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Scheduler, SchedulerConfig
from llmc.runtime.sequence import Sequence

VOCAB = 1000


def next_token(ids: list[int]) -> int:
    h = 17
    for t in ids:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return h % VOCAB


def make_seq(seq_id: int, prompt_len: int, max_tokens: int, priority: int = 0, base: int = 0) -> Sequence:
    prompt = [(base + seq_id * 7919 + i * 31) % VOCAB for i in range(prompt_len)]
    return Sequence(seq_id, prompt, SamplingParams(max_tokens=max_tokens), priority, arrival_time=float(seq_id))


class Simulation:
    def __init__(self, num_blocks: int, block_size: int = 16, max_num_seqs: int = 8,
                 max_batched_tokens: int = 64, prefix_caching: bool = True, chunked_prefill: bool = True):
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, SchedulerConfig(max_num_seqs, max_batched_tokens, chunked_prefill))
        self.steps = []

    def step(self):
        """Schedule and 'run' one step; return it (None when idle)."""
        step = self.scheduler.schedule()
        if step is None:
            return None
        self.steps.append(step)
        for c in step.chunks:
            c.seq.num_computed = c.end
            self.blocks.register_full_blocks(c.seq.seq_id, c.seq.all_ids, c.end)
        for c in step.chunks:
            if c.samples:
                c.seq.output_ids.append(next_token(c.seq.all_ids))
                if len(c.seq.output_ids) >= c.seq.params.max_tokens:
                    c.seq.finish("length", 0.0)
                    self.scheduler.finish(c.seq)
        return step

    def run(self, seqs: list[Sequence], max_steps: int = 10_000) -> None:
        for s in seqs:
            self.scheduler.add(s)
        for _ in range(max_steps):
            if self.step() is None:
                return
        raise AssertionError("simulation did not finish")


def reference_output(seq: Sequence) -> list[int]:
    ids, out = list(seq.prompt_ids), []
    for _ in range(seq.params.max_tokens):
        out.append(next_token(ids))
        ids.append(out[-1])
    return out
