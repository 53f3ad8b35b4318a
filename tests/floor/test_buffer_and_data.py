import json

import pytest

from envs.arithmetic import ArithmeticTask, answer_text, generate_problems
from envs.datasets import DatasetError, read_rows, write_rows
from rlsys.batch import collate
from rlsys.buffer import ExperienceBuffer
from rlsys.experience import EXPERIENCE_SCHEMA, make_experience, new_uid


def rows(n, version=0, offset=0):
    return [
        dict(
            uid=f"u{offset + i}",
            group=f"g{(offset + i) // 2}",
            prompt_ids=[1, 2, 3],
            response_ids=[4, 5],
            logprobs=[-0.1, -0.2],
            reward=float(i),
            policy_version=version,
            meta={"i": offset + i},
        )
        for i in range(n)
    ]


def test_experience_schema_and_defaults():
    t = make_experience(rows(3))
    assert t.schema.equals(EXPERIENCE_SCHEMA)
    assert t.column("loss_mask").to_pylist() == [[1, 1]] * 3
    assert json.loads(t.column("meta")[0].as_py()) == {"i": 0}
    with pytest.raises(ValueError, match="row 0 has no 'reward'"):
        make_experience([{k: v for k, v in rows(1)[0].items() if k != "reward"}])


def test_buffer_put_take_sample_staleness_and_parquet_round_trip(tmp_path):
    buf = ExperienceBuffer(max_staleness=1)
    buf.put(make_experience(rows(4, version=0)))
    buf.put(make_experience(rows(4, version=2, offset=4)))
    assert buf.size() == 8
    buf.set_policy_version(2)
    assert buf.sample(3, "latest").column("uid").to_pylist() == ["u5", "u6", "u7"]
    assert buf.stats()["dropped_stale"] == 4  # version 0 is 2 behind with a bound of 1
    path = tmp_path / "buf.parquet"
    buf.save(path)
    other = ExperienceBuffer()
    assert other.load(path) == 4
    assert other.take(2).column("uid").to_pylist() == ["u4", "u5"]
    assert other.size() == 2
    assert other.table.equals(buf.table.slice(2))


def test_tables_travel_as_one_ipc_stream_holding_only_a_slices_rows():
    from rlsys.experience import table_from_ipc, table_to_ipc

    table = make_experience(rows(400))
    part = table.slice(100, 8)
    back = table_from_ipc(table_to_ipc(part))
    assert back.equals(part) and back.schema.equals(EXPERIENCE_SCHEMA)
    assert table_to_ipc(part).size < table_to_ipc(table).size / 10


@pytest.mark.integration
def test_the_buffer_actor_hands_back_the_rows_put_into_it(ray_cluster):
    """Tables go to and from the buffer actor as IPC streams (registered in the driver and the actor)."""
    ray = ray_cluster
    buf = ray.remote(ExperienceBuffer).remote(max_staleness=0)
    table = make_experience(rows(40))
    ray.get(buf.put.remote(table.slice(10)))
    taken = ray.get(buf.take.remote(5))
    assert taken.equals(table.slice(10, 5)) and ray.get(buf.size.remote()) == 25
    ray.kill(buf)


def test_collate_aligns_per_token_columns_with_targets():
    r = rows(1)[0]
    r.update(prompt_ids=[7, 8], response_ids=[9, 10, 11], logprobs=[-1.0, -2.0, -3.0], loss_mask=[1, 0, 1])
    b = collate(make_experience([r, rows(1)[0]]))
    assert b.input_ids[0].tolist() == [7, 8, 9, 10, 11]
    # target index t predicts input_ids[t+1]: response tokens sit at targets 1..3
    assert b.response_mask[0].tolist() == [0, 1, 0, 1]
    assert b.old_logprobs[0].tolist() == [0, -1, -2, -3]
    assert b.attention_mask[1].tolist() == [1, 1, 1, 1, 1]
    assert b.ref_logprobs is None


def test_a_train_batch_travels_as_pickle5_buffers_and_arrives_writable():
    import pickle

    import torch

    r = rows(1)[0]
    r.update(prompt_ids=[7, 8], response_ids=[9, 10, 11], logprobs=[-1.0, -2.0, -3.0], loss_mask=[1, 0, 1])
    b = collate(make_experience([r, rows(1)[0]]))
    b.advantages = torch.randn(b.response_mask.shape)
    b.extras = {"bf16": torch.ones(2, 3, dtype=torch.bfloat16), "scores": torch.arange(2.0)}
    buffers = []
    payload = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)  # as Ray sends it
    # the tensors go out of band (Ray: zero-copy), not as torch.save bytes inside the payload
    assert len(buffers) >= 6 and len(payload) < 2000
    read_only = [memoryview(bytes(x.raw())).toreadonly() for x in buffers]  # what a receiver's store gives
    got = pickle.loads(payload, buffers=read_only)
    for name in ("input_ids", "attention_mask", "response_mask", "old_logprobs", "advantages"):
        sent, back = getattr(b, name), getattr(got, name)
        assert back.dtype == sent.dtype and torch.equal(back, sent)
    assert got.extras["bf16"].dtype == torch.bfloat16 and torch.equal(got.extras["scores"], b.extras["scores"])
    assert got.ref_logprobs is None
    got.advantages.add_(1.0)  # the learner may write into its batch: a copy, not the sender's read-only buffer
    assert torch.equal(got.advantages, b.advantages + 1.0)
    from algorithms.pilaf import GroupedBatch  # a subclass with its own fields comes back as itself

    grouped = pickle.loads(pickle.dumps(GroupedBatch.of(b, 2), protocol=5))
    assert type(grouped) is GroupedBatch and grouped.group_size == 2 and torch.equal(grouped.input_ids, b.input_ids)


def test_arithmetic_task_splits_are_disjoint_and_read_back(tmp_path):
    train, held = generate_problems(300, 50, 0, 20, ["+", "*"], seed=3)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    task = ArithmeticTask.create(tmp_path, 300, 50, 0, 20, ["+", "*"], seed=3)
    assert task.rows("eval") == held
    row = {"prompt": "2+3=", "answer": "5"}
    assert task.reward(row, "5") == 1.0 and task.reward(row, " 5 junk") == 1.0 and task.reward(row, "55") == 0.0
    assert answer_text("") == ""


def test_dataset_errors_name_file_and_row(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(DatasetError, match="row 2: missing field 'answer'"):
        read_rows(p, required=("prompt", "answer"))
    p.write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    with pytest.raises(DatasetError, match="line 2: not valid JSON"):
        read_rows(p)
    csv = tmp_path / "x.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unsupported format '.csv'"):
        read_rows(csv)
    assert read_rows(write_rows([{"a": 1}], tmp_path / "x.parquet")) == [{"a": 1}]


def test_a_per_token_column_longer_than_its_response_is_named():
    rows = [
        dict(
            uid=new_uid(),
            group="g",
            prompt_ids=[1, 2],
            response_ids=[3, 4],
            logprobs=[-0.1, -0.2],
            reward=1.0,
            policy_version=0,
        ),
        dict(
            uid=new_uid(),
            group="g",
            prompt_ids=[1],
            response_ids=[5],
            logprobs=[-0.1, -0.2, -0.3],
            reward=0.0,
            policy_version=0,
        ),
    ]
    with pytest.raises(ValueError, match="experience row 1: 'logprobs' has 3 values for 1 response tokens"):
        collate(make_experience(rows))


def test_buffer_batches_come_out_whole_oldest_first_and_a_stale_one_is_dropped_whole(tmp_path):
    """Async mode's batches: taken whole in order; one holding a row more than max_staleness
    versions behind is dropped whole and counted; the batches and the count survive a parquet round trip."""
    buf = ExperienceBuffer(max_staleness=1)
    first = make_experience(rows(2, version=0) + rows(2, version=1, offset=2))  # oldest row at version 0
    buf.put_batch(first)
    assert buf.put_batch(make_experience(rows(3, version=1, offset=10))) == 2
    buf.save(tmp_path / "b.parquet")
    buf.set_policy_version(1)
    table, dropped = buf.take_batch()
    assert dropped == 0 and table.column("uid").to_pylist() == ["u0", "u1", "u2", "u3"]
    buf.set_policy_version(3)  # the second batch (version 1) is now 2 behind
    table, dropped = buf.take_batch()
    assert table is None and dropped == 1
    assert buf.stats() == {"size": 0, "batches": 0, "dropped_stale": 3, "dropped_batches": 1, "version": 3}

    with pytest.raises(ValueError, match="a rollout batch of 0 rows"):
        buf.put_batch(make_experience([]))

    buf.put_batch(make_experience(rows(1, version=3, offset=20)))
    buf.save(tmp_path / "after_a_drop.parquet")
    resumed = ExperienceBuffer()
    assert resumed.load(tmp_path / "after_a_drop.parquet") == 1
    assert resumed.stats()["dropped_batches"] == 1  # the count goes on after a resume

    again = ExperienceBuffer(max_staleness=1)
    assert again.load(tmp_path / "b.parquet") == 7 and again.batches() == 2
    again.set_policy_version(2)  # the first batch's version-0 rows are 2 behind: it goes, the second stays
    table, dropped = again.take_batch()
    assert dropped == 1 and table.column("uid").to_pylist() == ["u10", "u11", "u12"]
