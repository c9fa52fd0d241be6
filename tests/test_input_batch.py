"""The persistent input batch against tables rebuilt from scratch, under random joins, growth, new tables
and leaves; and the runner's vectorized step inputs against a plain per-token reference."""

import random

import numpy as np

from novainfer.worker.input_batch import InputBatch


def check_rows(batch: InputBatch, tables: dict[int, list[int]]) -> None:
    assert sorted(batch.row_of) == sorted(tables)
    assert sorted(batch.row_of.values()) == list(range(len(tables)))  # compact: rows 0..n-1
    for seq_id, table in tables.items():
        row = batch.row_of[seq_id]
        assert batch.seq_ids[row] == seq_id
        assert batch.num_blocks[row] == len(table)
        assert batch.block_tables[row, : len(table)].tolist() == table


def test_rows_follow_random_joins_growth_and_leaves():
    rng = random.Random(0)
    batch = InputBatch(max_num_seqs=4, max_blocks_per_seq=32)  # fewer rows than sequences: it must grow
    tables: dict[int, list[int]] = {}
    next_id = 0
    for it in range(2000):
        op = rng.random()
        if op < 0.25 or not tables:
            tables[next_id] = [rng.randrange(1000) for _ in range(rng.randint(0, 3))]
            next_id += 1
        elif op < 0.45:
            del tables[(seq_id := rng.choice(list(tables)))]
            batch.remove(seq_id)
            continue
        elif op < 0.8:
            seq_id = rng.choice(list(tables))
            if len(tables[seq_id]) < 32:
                tables[seq_id].append(rng.randrange(1000))  # grown in place, as the block manager does
        else:
            seq_id = rng.choice(list(tables))
            tables[seq_id] = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]  # preempted, readmitted
        for seq_id in rng.sample(list(tables), k=min(len(tables), 3)):  # the sequences a step schedules
            batch.row(seq_id, tables[seq_id])
        if it % 50 == 49:
            for seq_id, table in tables.items():  # rows not scheduled lately catch up on their deltas
                batch.row(seq_id, table)
            check_rows(batch, tables)
    batch.remove(10**9)  # unknown ids are ignored


def test_gather_equals_row_per_sequence():
    """gather() (one pass, row() only for new or grown tables) keeps the same rows as calling row() for each."""
    from types import SimpleNamespace as NS

    rng = random.Random(1)
    by_row, by_gather = InputBatch(4, 32), InputBatch(4, 32)
    seqs: dict[int, NS] = {}
    for it in range(1500):
        op = rng.random()
        if op < 0.2 or not seqs:
            seqs[it] = NS(seq_id=it, block_table=[rng.randrange(1000) for _ in range(rng.randint(0, 3))])
        elif op < 0.35:
            seq_id = rng.choice(list(seqs))
            del seqs[seq_id]
            by_row.remove(seq_id)
            by_gather.remove(seq_id)
        elif op < 0.8:
            table = rng.choice(list(seqs.values())).block_table
            if len(table) < 32:
                table.append(rng.randrange(1000))
        else:
            rng.choice(list(seqs.values())).block_table = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]
        step = [
            NS(seq=seq, start=rng.randrange(100), num_new_tokens=rng.randint(1, 9))
            for seq in rng.sample(list(seqs.values()), k=min(len(seqs), 3))
        ]
        rows, starts, counts = by_gather.gather(step)
        assert rows.tolist() == [by_row.row(s.seq.seq_id, s.seq.block_table) for s in step]
        assert starts.tolist() == [s.start for s in step] and counts.tolist() == [s.num_new_tokens for s in step]
        assert by_gather.row_of == by_row.row_of
        n = len(by_row.row_of)
        assert by_gather.num_blocks[:n].tolist() == by_row.num_blocks[:n].tolist()
        for row in rows.tolist():
            width = int(by_row.num_blocks[row])
            assert by_gather.block_tables[row, :width].tolist() == by_row.block_tables[row, :width].tolist()
    assert by_gather.gather([])[0].dtype == np.int64


def test_slots_match_per_token_arithmetic():
    batch = InputBatch(8, 16)
    tables = {3: [5, 9, 2], 7: [11], 8: [4, 6]}
    rows = np.array([batch.row(s, t) for s, t in tables.items()])
    positions = np.array([33, 0, 17])
    slots = batch.slots(rows, positions, 16)
    assert slots.tolist() == [2 * 16 + 1, 11 * 16 + 0, 6 * 16 + 1]


def test_runner_step_inputs_match_reference(tmp_path):
    """Mixed prefill chunks and decodes: ids, positions, slots, offsets and tables as the per-token loop had them."""
    from novainfer import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model(str(tmp_path / "m"))
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=40, block_size=4, cpu_kv_cache_tokens=512)
    engine = llm.llm_engine
    runner = engine.executor.workers[0].model_runner
    for i, n in enumerate([3, 30, 7, 12]):
        engine.add_request(str(i), list(range(1 + i, 1 + i + n)), SamplingParams(max_tokens=6, ignore_eos=True))
    seen = 0
    while engine.has_unfinished_requests():
        sched = engine.scheduler.schedule()
        engine.scheduler.schedule = lambda sched=sched: sched
        inp = runner.prepare_step_inputs(sched)
        ids, pos, slots, qsl, tables = [], [], [], [0], []
        for s in sched.scheduled:
            seq, start = s.seq, s.start
            for p in range(start, start + s.num_new_tokens):
                ids.append(seq.token_ids[p])
                pos.append(p)
                slots.append(seq.block_table[p // 4] * 4 + p % 4)
            qsl.append(qsl[-1] + s.num_new_tokens)
            tables.append(seq.block_table)
        assert inp.input_ids.tolist() == ids and inp.positions.tolist() == pos
        assert inp.slot_mapping.tolist() == slots and inp.query_start_loc == qsl
        for row, table in zip(inp.block_tables.tolist(), tables):
            assert row[: len(table)] == table
        engine.step()  # runs the same step (preparing it again is idempotent)
        del engine.scheduler.schedule
        seen += 1
    assert seen > 4
