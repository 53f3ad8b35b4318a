"""Weight-sync integrity: every sync carries the learner's checksums (rlsys/weight_digest.py)
and a rollout worker checks what it received before it loads it. A byte flipped in the
shared-memory slot or in the object store's copy is named (worker, version, tensor); the
controller sends corrupt weights once more, and a second failure stops the run in one line."""

import numpy as np
import pytest
import torch

from actors.modeling import state_dict_numpy, tied_state_dict
from actors.shared_weights import SharedLayout, SharedWeights
from rlsys.errors import WeightsCorrupt
from rlsys.weight_digest import as_int64, digest, first_mismatch, from_int64, tensor_hash


@pytest.fixture
def model_dir(tmp_path):
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    tok = train_tokenizer(["1+2=3", "4+5=9"], vocab_size=48)
    model = build_tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2), tok, seed=0)
    return save_model_dir(model, tok, tmp_path / "policy")


def flipped(weights: dict, name: str) -> dict:
    """A copy of `weights` with one byte of `name` changed."""
    out = {k: v.copy() for k, v in weights.items()}
    out[name].reshape(-1).view(np.uint8)[7] ^= 0x10
    return out


def test_digest_names_the_tensor_whose_bytes_differ():
    a = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    d = digest(a)
    assert first_mismatch(d, a) is None and d["w"] == tensor_hash(torch.from_numpy(a["w"]))  # numpy or torch
    assert first_mismatch(d, {**a, "b": a["b"] + 1}) == "b" and first_mismatch(d, {"b": a["b"]}) == "w"
    assert first_mismatch(d, {**a, "w": a["w"].T.copy().T}) is None  # the same values, another memory order
    assert first_mismatch(d, flipped({"w": a["w"]}, "w") | {"b": a["b"]}) == "w"
    assert from_int64(as_int64(d.values())) == list(d.values())  # through a process group's int64 tensor


def test_a_byte_flipped_in_a_shared_memory_slot_is_named_by_the_worker(tmp_path, model_dir):
    from actors.rollout import RolloutWorker
    from rlsys.models import load_model

    state = tied_state_dict(load_model(model_dir))
    layout = SharedLayout.of(tmp_path / "rlsys-weights-test", state)
    SharedWeights(layout, create=True).write(1, state)
    worker = RolloutWorker(str(model_dir), index=3)
    assert worker.load_shared(5, layout, 1) == 5 and worker.shared.verify(1) is None
    name, _, _, offset = layout.entries[2]
    raw = np.memmap(layout.path, dtype=np.uint8, mode="r+")
    raw[layout.slot_bytes + offset + 5] ^= 0x01  # slot 1, third tensor: what a torn write would leave
    raw.flush()
    assert SharedWeights(layout).verify(1) == name and SharedWeights(layout).verify(0) is not None  # 0: unwritten
    with pytest.raises(WeightsCorrupt) as e:
        worker.load_shared(7, layout, 1)
    assert str(e.value) == (
        f"rollout worker 3: the weights of version 7 arrived corrupt through shared memory ({layout.path}, slot 1): "
        f"tensor {name} does not match the learner's checksum"
    )
    assert worker.version == 5  # it kept serving what it had


def test_object_store_weights_that_arrive_corrupt_are_sent_again_then_stop_the_run(ray_cluster, model_dir, capfd):
    """A worker actor loads through the object store what the learner hashed (`digest`) but with
    a byte changed in transit: once, the resend heals it; twice, the run stops in one line."""
    from actors.rollout import RolloutWorker
    from rlsys.models import load_model
    from rlsys.run.weight_sync import InFlight

    worker = ray_cluster.remote(RolloutWorker).remote(str(model_dir), index=1)
    good = state_dict_numpy(load_model(model_dir))
    name = "model.layers.1.mlp.down_proj.weight"
    sent, corrupt = ray_cluster.put(good), ray_cluster.put(flipped(good, name))
    checksums = ray_cluster.put(digest(good))
    get = ray_cluster.get

    healed = InFlight(1)
    healed.add(
        worker.load_weights.remote(1, corrupt, checksums), lambda: worker.load_weights.remote(1, sent, checksums)
    )
    healed.wait(60, get)
    assert get(worker.policy_version.remote()) == 1
    assert "rollout worker 1: the weights of version 1 arrived corrupt" in capfd.readouterr().err

    broken = InFlight(2)
    again = lambda: worker.load_weights.remote(2, corrupt, checksums)  # noqa: E731
    broken.add(again(), again)
    with pytest.raises(WeightsCorrupt) as e:
        broken.wait(60, get)
    message = str(e.value)
    assert "\n" not in message and message == (
        f"rollout worker 1: the weights of version 2 arrived corrupt through the object store: tensor {name} "
        f"does not match the learner's checksum (twice: the run stopped)"
    )
    assert get(worker.policy_version.remote()) == 1


def test_corrupt_weights_are_not_sent_again_once_newer_ones_are_on_their_way(ray_cluster, model_dir, capfd):
    """Under async a sync is not awaited before the next: when version 1 arrived corrupt and
    version 2 is already queued behind it, sending 1 again would load after 2 and take the worker
    back a version. The superseded sync is settled without a resend; the worker holds 2."""
    from actors.rollout import RolloutWorker
    from rlsys.models import load_model
    from rlsys.run.weight_sync import InFlight, settle_in_order

    worker = ray_cluster.remote(RolloutWorker).remote(str(model_dir), index=4)
    good = state_dict_numpy(load_model(model_dir))
    name = "model.layers.0.self_attn.q_proj.weight"
    checksums = ray_cluster.put(digest(good))
    corrupt, sent = ray_cluster.put(flipped(good, name)), ray_cluster.put(good)
    get, resent = ray_cluster.get, []

    first = InFlight(1)
    first.add(worker.load_weights.remote(1, corrupt, checksums), lambda: resent.append(1))
    second = InFlight(2)
    second.add(worker.load_weights.remote(2, sent, checksums), lambda: resent.append(2))
    in_flight = [first, second]
    settle_in_order(in_flight, 60, get, finished_only=False)
    assert in_flight == [] and resent == [] and get(worker.policy_version.remote()) == 2
    assert "rollout worker 4: the weights of version 1 arrived corrupt" in capfd.readouterr().err
    again = InFlight(3)
    again.add(worker.load_weights.remote(3, corrupt, checksums), lambda: worker.load_weights.remote(3, sent, checksums))
    again.wait(60, get)  # nothing newer on its way: sent once more, and loaded
    assert get(worker.policy_version.remote()) == 3


def test_a_bucket_that_arrives_corrupt_is_named_with_its_place_and_leaves_the_version(ray_cluster, model_dir):
    """A sync in buckets (trainer.sync_bucket_mb): each bucket is checked against its own
    checksums; the version moves only with the last bucket."""
    from actors.modeling import size_buckets
    from actors.rollout import RolloutWorker
    from rlsys.models import load_model

    worker = ray_cluster.remote(RolloutWorker).remote(str(model_dir), index=2)
    good = state_dict_numpy(load_model(model_dir))
    names = size_buckets({k: v.nbytes for k, v in good.items()}, 20_000)
    assert len(names) >= 3
    buckets = [{k: good[k] for k in b} for b in names]
    get = ray_cluster.get
    assert get(worker.load_weights.remote(4, buckets[0], digest(buckets[0]), (0, len(buckets)))) == 4
    assert get(worker.policy_version.remote()) == 0  # not before the last bucket
    name = names[1][0]
    with pytest.raises(WeightsCorrupt) as e:
        get(worker.load_weights.remote(4, flipped(buckets[1], name), digest(buckets[1]), (1, len(buckets))))
    assert f"arrived corrupt through the object store (bucket 1 of {len(buckets)}): tensor {name} does" in str(e.value)
    for i, b in enumerate(buckets[1:], start=1):
        get(worker.load_weights.remote(4, b, digest(b), (i, len(buckets))))
    assert get(worker.policy_version.remote()) == 4


def test_size_buckets_keep_order_and_bound_each_bucket():
    from actors.modeling import size_buckets

    sizes = {"a": 40, "b": 30, "c": 50, "d": 120, "e": 10, "f": 0}
    assert size_buckets(sizes, 80) == [["a", "b"], ["c"], ["d"], ["e", "f"]]  # d alone: larger than the bound
    assert size_buckets(sizes, 1e9) == [list(sizes)] and size_buckets({}, 10) == []


def test_loading_a_model_bucket_by_bucket_equals_loading_it_whole(model_dir):
    from actors.modeling import adopt_numpy_state, load_numpy_state, size_buckets
    from rlsys.models import load_model

    source, whole, parts = load_model(model_dir), load_model(model_dir), load_model(model_dir)
    for param in source.parameters():
        param.data.mul_(1.5)
    weights = state_dict_numpy(source)
    adopt_numpy_state(whole, weights)
    for names in size_buckets({k: v.nbytes for k, v in weights.items()}, 20_000):
        adopt_numpy_state(parts, {k: weights[k] for k in names}, partial=True)
    assert digest(state_dict_numpy(parts)) == digest(state_dict_numpy(whole)) == digest(weights)
    with pytest.raises(KeyError, match="a weights bucket holds 1 tensors the model lacks, e.g. extra"):
        load_numpy_state(parts, {"extra": weights["lm_head.weight"]}, partial=True)
