"""InputBatch on plain integers: at every step its vectorised build equals build_step_inputs
(torch.equal, dtypes and shapes too) while a Scheduler and BlockManager run with prefix caching,
copy-on-write, preemption, speculative trims, prompt logprobs, aborts and re-admission; and a
decode step copies only the block-table entries that changed (BlockManager.take_table_changes)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import fields

import pytest
import torch

from llmc.runtime.block_manager import BlockManager, TableChanges
from llmc.runtime.input_batch import InputBatch
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk, Scheduler, SchedulerConfig
from llmc.runtime.sequence import Sequence
from llmc.runtime.step_inputs import StepInputs, build_step_inputs
from sim import VOCAB, make_seq, next_token

BS = 4


def assert_same(got: StepInputs, want: StepInputs) -> None:
    for f in fields(StepInputs):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a.dtype == b.dtype and a.shape == b.shape, (f.name, a, b)
        assert torch.equal(a, b), (f.name, a, b)


def assert_rows_match(batch: InputBatch, bm: BlockManager) -> None:
    """Every live table is its row, zero-padded; every other row is all zeros."""
    assert batch.seq_ids == set(bm._tables)
    held = set()
    for seq_id, table in bm._tables.items():
        row = batch.row(seq_id)
        held.add(row)
        assert batch.num_blocks[row] == len(table)
        assert batch.block_table[row].tolist() == table + [0] * (batch.width - len(table))
    for row in set(range(batch.num_rows)) - held:
        assert batch.num_blocks[row] == 0 and not batch.block_table[row].any()


class Driver:
    """A Scheduler and BlockManager driven as the engine drives them (drafts verified, rejected ones
    trimmed; prompt logprobs scored; aborts), checking InputBatch against build_step_inputs at every
    step. Prompts share a few cached prefixes, so copy-on-write happens, and blocks are few, so
    preemption does."""

    def __init__(self, seed: int, num_blocks: int = 14, max_num_seqs: int = 6, max_batched_tokens: int = 16):
        self.rng = random.Random(seed)
        self.blocks = BlockManager(num_blocks, BS)
        self.scheduler = Scheduler(self.blocks, SchedulerConfig(max_num_seqs, max_batched_tokens))
        self.batch = InputBatch(self.blocks, max_rows=1, max_width=1)
        self.bases = [[self.rng.randrange(VOCAB) for _ in range(2 * BS)] for _ in range(3)]
        self.stats: Counter[str] = Counter()
        self.preempted: set[int] = set()                     # preempted, not yet scheduled again

    def arrive(self, seq_id: int) -> None:
        """A new request: a shared prefix (0-2 blocks) and a random tail, or, asking for prompt
        logprobs, a prompt of its own (the scheduler does not yet count the copy-on-write blocks
        that recomputing cached prompt blocks takes: under pressure that runs out of blocks)."""
        rng = self.rng
        logprobs = rng.random() < 0.2
        prefix = [] if logprobs else rng.choice(self.bases)[:rng.choice([0, BS, 2 * BS, 2 * BS])]
        tail_length = rng.choice([4, 6]) if logprobs else rng.choice([0, 0, 1, 3, 6])
        tail = [rng.randrange(VOCAB) for _ in range(tail_length)]
        params = SamplingParams(max_tokens=rng.randint(1, 24), prompt_logprobs=1 if logprobs else None)
        prompt = prefix + tail or [rng.randrange(VOCAB)]
        self.scheduler.add(Sequence(seq_id, prompt, params, rng.randint(0, 2), arrival_time=float(seq_id)))

    def step(self) -> bool:
        """Draft, abort now and then, schedule, check the build, commit; False when nothing ran."""
        for seq in self.scheduler.running:
            if seq.is_decoding and self.rng.random() < 0.5:
                seq.draft_ids = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 6))]
        if self.rng.random() < 0.03 and self.scheduler.running:
            aborted = self.rng.choice(self.scheduler.running)
            aborted.finish("abort", 0.0)
            self.scheduler.finish(aborted)
            self.stats["aborts"] += 1
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return False
        chunks = scheduled.chunks
        self.stats["copies"] += len(scheduled.copies)
        self.stats["multi_logit_chunks"] += sum(c.num_logits > 1 for c in chunks)
        self.stats["decode_steps"] += all(c.end - c.start == 1 and c.num_logits == 1 for c in chunks)
        self.stats["readmitted"] += len(self.preempted & {c.seq.seq_id for c in chunks})
        self.preempted = (self.preempted - {c.seq.seq_id for c in chunks}) | {s.seq_id for s in scheduled.preempted}
        assert_same(self.batch.build(chunks), build_step_inputs(chunks, self.blocks))
        assert_rows_match(self.batch, self.blocks)
        for c in chunks:
            self.commit(c)
        return True

    def commit(self, c: Chunk) -> None:
        """What the engine's _commit does with a computed chunk, accepting a random number of drafts."""
        seq, num_drafts = c.seq, c.num_drafts
        drafts, seq.draft_ids = seq.draft_ids[:num_drafts], []
        if seq.params.prompt_logprobs is not None:
            seq.prompt_scored = max(seq.prompt_scored, min(c.end, len(seq.prompt_ids) - 1))
        if not num_drafts:
            seq.num_computed = c.end
            self.blocks.register_full_blocks(seq.seq_id, seq.all_ids, c.end)
        if not c.samples:
            return
        new = drafts[:self.rng.randint(0, num_drafts)] + [next_token(seq.all_ids)]
        seq.output_ids += new[:seq.params.max_tokens - len(seq.output_ids)]
        finished = len(seq.output_ids) >= seq.params.max_tokens
        if num_drafts and not finished:
            seq.num_computed = seq.num_tokens - 1
            before = len(self.blocks.block_table(seq.seq_id))
            self.blocks.trim(seq.seq_id, seq.num_computed)
            self.stats["trimmed_blocks"] += before - len(self.blocks.block_table(seq.seq_id))
            self.blocks.register_full_blocks(seq.seq_id, seq.all_ids, seq.num_computed)
        if finished:
            seq.finish("length", 0.0)
            self.scheduler.finish(seq)

    def run(self, num_seqs: int) -> None:
        arrived = 0
        for _ in range(5000):
            while arrived < num_seqs and self.rng.random() < 0.4:
                self.arrive(arrived)
                arrived += 1
            if not self.step() and arrived == num_seqs and not self.scheduler.has_work():
                return
        raise AssertionError("the simulation did not finish")


@pytest.mark.parametrize("seed", range(4))
def test_build_equals_build_step_inputs_through_preemption_cow_trim_and_frees(seed):
    driver = Driver(seed)
    driver.run(num_seqs=60)
    stats = driver.stats | Counter(preemptions=driver.scheduler.num_preemptions)
    for what in ("copies", "multi_logit_chunks", "decode_steps", "readmitted", "trimmed_blocks", "preemptions"):
        assert stats[what] > 0, f"seed {seed} never exercised {what}: {dict(stats)}"
    assert driver.batch.num_rows > 1 and driver.batch.width > 1          # both grew from 1
    driver.batch.sync()                                                  # the last frees
    assert driver.batch.seq_ids == set() and not driver.batch.block_table.any()


def chunk_step(bm: BlockManager, batch: InputBatch, chunks: list[Chunk]) -> StepInputs:
    got = batch.build(chunks)
    assert_same(got, build_step_inputs(chunks, bm))
    return got


def prefill(bm: BlockManager, seq: Sequence) -> Chunk:
    bm.allocate(seq.seq_id, seq.all_ids)
    return Chunk(seq, 0, seq.num_tokens)


def test_one_token_step():
    bm = BlockManager(4, BS)
    batch = InputBatch(bm)
    seq = make_seq(0, 1, 5)
    got = chunk_step(bm, batch, [prefill(bm, seq)])
    assert got.input_ids.shape == (1,) and got.block_tables.shape == (1, 1)


def test_feeds_name_every_field_and_the_cache():
    bm = BlockManager(4, BS)
    seq = make_seq(0, 3, 5)
    step = InputBatch(bm).build([prefill(bm, seq)])
    cache = torch.zeros(1)
    feeds = step.feeds(cache)
    assert set(feeds) == {f.name for f in fields(StepInputs)} | {"kv_cache"} and feeds["kv_cache"] is cache
    assert all(feeds[f.name] is getattr(step, f.name) for f in fields(StepInputs))


def test_single_chunk_prefill_then_decode():
    bm = BlockManager(8, BS)
    batch = InputBatch(bm)
    seq = make_seq(0, 9, 5)
    chunk_step(bm, batch, [prefill(bm, seq)])
    seq.output_ids.append(7)
    bm.append(0, 10)
    chunk_step(bm, batch, [Chunk(seq, 9, 10)])


def test_rows_and_width_grow_past_their_initial_capacity():
    bm = BlockManager(64, BS)
    batch = InputBatch(bm, max_rows=2, max_width=1)
    seqs = [make_seq(i, 1 + 5 * i, 5) for i in range(7)]          # up to 31 tokens: 8 blocks
    chunk_step(bm, batch, [prefill(bm, s) for s in seqs])
    assert batch.num_rows == 8 and batch.width == 8
    assert_rows_match(batch, bm)


def test_chunks_with_no_one_and_several_logit_rows():
    bm = BlockManager(16, BS)
    batch = InputBatch(bm)
    seqs = [make_seq(i, 6, 5) for i in range(3)]
    for s in seqs:
        bm.allocate(s.seq_id, s.all_ids)
    chunks = [Chunk(seqs[0], 0, 4, num_logits=0), Chunk(seqs[1], 0, 6, num_logits=3), Chunk(seqs[2], 2, 6)]
    got = chunk_step(bm, batch, chunks)
    assert got.logits_indices.tolist() == [7, 8, 9, 13]


def test_a_copy_on_write_between_steps_reaches_the_row():
    """A running sequence recomputing cached blocks (prompt logprobs) copies them one chunk at a time:
    the scheduled simulation above only copies at admission, in the same step as `allocate`."""
    bm = BlockManager(16, BS)
    batch = InputBatch(bm)
    prompt = list(range(8))
    owner, reader = (Sequence(i, list(prompt), SamplingParams()) for i in range(2))
    chunk_step(bm, batch, [prefill(bm, owner)])
    bm.register_full_blocks(0, prompt, 8)
    assert bm.allocate(1, prompt) == 8
    for start in (0, BS):
        bm.prepare_write(1, start, start + BS)
        assert bm.take_copies()
        chunk_step(bm, batch, [Chunk(owner, 7, 8), Chunk(reader, start, start + BS)])
    assert_rows_match(batch, bm)


def test_changes_are_tracked_from_the_first_take():
    bm = BlockManager(16, BS)
    bm.allocate(0, list(range(5)))
    bm.append(0, 9)
    bm.free(0)
    bm.allocate(1, list(range(6)))
    first = bm.take_table_changes()                                # whole live tables, nothing freed
    assert first.changed == {1: 0} and first.freed == set()
    assert bm.take_table_changes().changed == {}


def test_each_table_edit_reports_its_lowest_index():
    bm = BlockManager(16, BS)
    bm.take_table_changes()
    prompt = list(range(8))
    bm.allocate(0, prompt)
    bm.register_full_blocks(0, prompt, 8)
    bm.allocate(1, prompt)                                         # both blocks shared
    assert bm.take_table_changes().changed == {0: 0, 1: 0}
    bm.prepare_write(1, 7, 8)                                      # copy-on-write of block 1
    bm.append(1, 13)                                               # blocks 2 and 3
    bm.append(0, 8)                                                # no new block: no change
    assert bm.take_table_changes().changed == {1: 1}
    bm.append(0, 17)
    bm.trim(0, 9)                                                  # blocks 3, 4 go: table cut at 3
    assert bm.take_table_changes().changed == {0: 2}
    bm.trim(1, 12)
    assert bm.take_table_changes().changed == {1: 3}
    bm.append(1, 20)
    bm.free(1)                                                     # freed: its changes go with it
    bm.free(7)                                                     # no table: not reported
    changes = bm.take_table_changes()
    assert changes.changed == {} and changes.freed == {1}
    bm.free(0)
    bm.allocate(0, prompt)                                         # preempted and admitted again
    changes = bm.take_table_changes()
    assert changes.changed == {0: 0} and changes.freed == {0}


class CountingBlockManager(BlockManager):
    """Counts the per-sequence reads a step's build makes; keeps the table changes it hands out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: Counter[str] = Counter()
        self.taken: list[TableChanges] = []

    def take_table_changes(self) -> TableChanges:
        self.taken.append(super().take_table_changes())
        return self.taken[-1]

    def block_table(self, seq_id: int) -> list[int]:
        self.reads["block_table"] += 1
        return super().block_table(seq_id)

    def slot(self, seq_id: int, position: int) -> int:
        self.reads["slot"] += 1
        return super().slot(seq_id, position)


def test_a_decode_step_copies_only_the_changed_entries():
    bm = CountingBlockManager(8 * 130, 16, enable_prefix_caching=False)
    batch = InputBatch(bm)
    seqs = [make_seq(i, 2048 if i % 2 else 2050, 5) for i in range(8)]    # 128 or 129 blocks each
    batch.build([prefill(bm, s) for s in seqs])
    assert batch.entries_copied == sum(len(bm.block_table(s.seq_id)) for s in seqs)
    for s in seqs:                                                        # one decode token each
        s.output_ids.append(3)
        bm.append(s.seq_id, s.num_tokens)
    copied, bm.reads = batch.entries_copied, Counter()
    chunks = [Chunk(s, s.num_tokens - 1, s.num_tokens) for s in seqs]
    got = batch.build(chunks)
    changes = bm.taken[-1]
    assert changes.changed == {s.seq_id: 128 for s in seqs if s.seq_id % 2} and not changes.freed
    assert batch.entries_copied - copied == 4                             # the four new blocks, nothing else
    assert bm.reads == Counter(block_table=4)                             # no slot() call, no other table read
    assert_same(got, build_step_inputs(chunks, bm))
    copied = batch.entries_copied
    batch.build(chunks)                                                   # nothing changed since
    assert batch.entries_copied == copied
