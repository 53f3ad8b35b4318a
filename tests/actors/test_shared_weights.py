"""Weight sync through a /dev/shm file on learner rank 0's node (actors/shared_weights.py)."""

import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from fakes import TINY_JOB

from actors.modeling import tied_names
from actors.shared_weights import ALIGN, BF16, SLOTS, SharedLayout, SharedWeights, remove_stale

TINY = [
    *TINY_JOB,
    "rollout.max_new_tokens=4",
    "rollout.num_workers=2",
]


def _tiny_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=48,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()


def _layout(tmp_path, model, name="rlsys-weights-test"):
    from actors.modeling import tied_state_dict

    return SharedLayout.of(tmp_path / name, tied_state_dict(model))  # as Learner.share_weights builds it


def test_slots_hold_aligned_disjoint_copies_of_the_state_dict(tmp_path):
    model = _tiny_model(0)
    layout = _layout(tmp_path, model)
    assert all(offset % ALIGN == 0 for *_, offset in layout.entries) and len({e[3] for e in layout.entries}) == len(
        layout.entries
    )
    ends = [offset + int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt, offset in layout.entries]
    assert all(end <= nxt for end, (*_, nxt) in zip(ends, layout.entries[1:])) and ends[-1] <= layout.slot_bytes
    writer = SharedWeights(layout, create=True)
    assert os.path.getsize(layout.path) == layout.file_bytes == SLOTS * (layout.slot_bytes + layout.digest_bytes)
    state = model.state_dict()
    writer.write(0, state)
    other = _tiny_model(1).state_dict()
    writer.write(1, other)
    reader = SharedWeights(layout)  # another mapping of the same file, as a rollout worker's
    for slot, expected in ((0, state), (1, other)):
        got = reader.arrays(slot)
        assert list(got) == list(expected)
        assert all(np.array_equal(got[k], expected[k].numpy()) for k in expected)


def test_a_worker_adopting_a_slot_serves_the_writers_weights_without_a_copy(tmp_path):
    """The model's parameters become views of the slot: it computes what the learner's model
    computes, and a later write into that slot would change it (hence two slots)."""
    from actors.modeling import adopt_numpy_state

    learner, worker = _tiny_model(0), _tiny_model(1)
    layout = _layout(tmp_path, learner)
    SharedWeights(layout, create=True).write(1, learner.state_dict())
    shared = SharedWeights(layout)
    adopt_numpy_state(worker, shared.arrays(1))
    ids = torch.tensor([[3, 5, 7, 11]])
    with torch.no_grad():
        assert torch.equal(worker(ids).logits, learner(ids).logits)
        shared.arrays(1)["model.norm.weight"][:] = 0.0
        assert not torch.equal(worker(ids).logits, learner(ids).logits)


def test_tied_weights_are_stored_once_and_stay_tied_in_the_worker(tmp_path):
    """A model whose lm_head is its embedding: the slot holds that matrix once (the file is
    smaller by it), both names read the same bytes, and the adopting worker's lm_head and
    embedding stay one tensor that computes what the learner's does."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from actors.modeling import adopt_numpy_state, state_dict_numpy

    def tied(seed):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=48,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=True,
            )
        ).eval()

    learner, worker = tied(0), tied(1)
    state = learner.state_dict()
    assert tied_names(state) == {"lm_head.weight": "model.embed_tokens.weight"}
    arrays = state_dict_numpy(learner)  # the object-store sync's dict: one array object, so pickle sends it once
    assert arrays["lm_head.weight"] is arrays["model.embed_tokens.weight"]
    buffers = []
    pickle.dumps(arrays, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(arrays) - 1
    layout = _layout(tmp_path, learner, "rlsys-weights-tied")
    untied = SharedLayout.of(
        tmp_path / "rlsys-weights-untied", {k: a.copy() for k, a in arrays.items()}
    )  # one array per name
    assert untied.slot_bytes - layout.slot_bytes == 48 * 32 * 4
    SharedWeights(layout, create=True).write(0, state)
    got = SharedWeights(layout).arrays(0)
    assert np.shares_memory(got["lm_head.weight"], got["model.embed_tokens.weight"])
    adopt_numpy_state(worker, got)
    assert worker.lm_head.weight is worker.model.embed_tokens.weight
    ids = torch.tensor([[3, 5, 7, 11]])
    with torch.no_grad():
        assert torch.equal(worker(ids).logits, learner(ids).logits)


def test_a_bf16_learners_slots_hold_bf16_which_a_bf16_worker_adopts_and_an_fp32_one_casts(tmp_path):
    """A bf16 learner (DeepSpeed bf16) gets a file half an fp32 one's size, not fp32 copies."""
    from actors.modeling import adopt_numpy_state

    learner = _tiny_model(0).to(torch.bfloat16)
    layout = _layout(tmp_path, learner)
    assert {dt for _, _, dt, _ in layout.entries} == {BF16}
    assert layout.slot_bytes <= 0.55 * _layout(tmp_path, _tiny_model(0), "rlsys-weights-fp32").slot_bytes
    state = learner.state_dict()
    SharedWeights(layout, create=True).write(0, state)
    got = SharedWeights(layout).arrays(0)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v) for k, v in state.items())
    ids = torch.tensor([[3, 5, 7, 11]])
    bf16_worker, fp32_worker = _tiny_model(1).to(torch.bfloat16), _tiny_model(1)
    adopt_numpy_state(bf16_worker, got)
    adopt_numpy_state(fp32_worker, got)
    assert bf16_worker.model.norm.weight.data_ptr() == got["model.norm.weight"].data_ptr()  # a view, no copy
    assert all(torch.equal(v.float(), fp32_worker.state_dict()[k]) for k, v in state.items())
    with torch.no_grad():
        assert torch.equal(bf16_worker(ids).logits, learner(ids).logits)


def test_bf16_weights_written_into_a_float32_layout_are_cast(tmp_path):
    from actors.modeling import state_dict_numpy

    model = _tiny_model(0)
    layout = SharedLayout.of(tmp_path / "rlsys-weights-f32", state_dict_numpy(model, copy=False))
    bf16 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    SharedWeights(layout, create=True).write(0, bf16)
    got = SharedWeights(layout).arrays(0)
    assert all(got[k].dtype == np.float32 and np.array_equal(got[k], bf16[k].float().numpy()) for k in bf16)


def test_a_file_of_another_size_and_a_missing_tensor_are_named(tmp_path):
    model = _tiny_model(0)
    layout = _layout(tmp_path, model)
    writer = SharedWeights(layout, create=True)
    with pytest.raises(KeyError, match="no tensor for \\['lm_head.weight'\\]"):
        writer.write(0, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    with open(layout.path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match=f"shared weights file {layout.path} is {layout.file_bytes + 1} bytes"):
        SharedWeights(layout)
    with pytest.raises(ValueError, match="slot 2 \\(the file has 2\\)"):
        writer.arrays(2)


def test_files_of_dead_owners_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"rlsys-weights-{int(dead.stdout)}-policy"
    live = tmp_path / f"rlsys-weights-{os.getpid()}-policy"
    other = tmp_path / "rlsys-weights-notapid"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    assert remove_stale(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and other.exists()


# ---- on Ray: the controller's default sync on one node ------------------------------------------
def _controller(tmp_path, name: str, *overrides):
    from rlsys.config import load_config
    from rlsys.run.controller import Controller

    cfg = load_config("configs/quickstart.yaml", [*TINY, f"run.output_dir={tmp_path}", f"run.name={name}", *overrides])
    c = Controller(cfg, tmp_path / name, progress=False)
    c.start_actors(c.prepare_policy())
    return c


def _served(ray, worker) -> dict:
    from actors.modeling import state_dict_numpy

    return ray.get(worker.__ray_call__.remote(lambda self: state_dict_numpy(self.backend.model)))


@pytest.mark.integration
def test_auto_sync_on_one_node_goes_through_shared_memory_and_the_file_goes_with_the_run(ray_cluster, tmp_path):
    ray = ray_cluster
    c = _controller(tmp_path, "shm")
    shared = c.policies["policy"].shared
    assert shared is not None and os.path.exists(shared.path) and shared.path.startswith("/dev/shm/")
    for step in (1, 2):  # two steps: both slots written; the workers serve each version exactly
        ray.get(
            c.learners[0].__ray_call__.remote(  # move the weights (a tiny model's step may have zero advantages)
                lambda self: [p.data.add_(0.01 * torch.randn_like(p)) for p in self.module.policy.parameters()] and None
            )
        )
        metrics = c.train_step()
        assert metrics["policy_version"] == step
        c.ctx.settle_sync()
        learner = ray.get(c.learners[0].weights.remote())
        assert ray.get([w.policy_version.remote() for w in c.workers]) == [step, step]
        for worker in c.workers:
            served = _served(ray, worker)
            assert all(np.array_equal(served[k], learner[k]) for k in learner)
    assert c.policies["policy"].weights_ref is None  # no object-store copy unless one is needed
    assert set(ray.get(c.weights.weights_ref("policy")).keys()) == set(
        learner
    )  # (an attached evaluator, say): asked of the learner
    c.shutdown()
    assert not os.path.exists(shared.path)


@pytest.mark.integration
def test_shared_memory_refused_falls_back_under_auto_and_is_one_line_when_asked_for(ray_cluster, tmp_path):
    """Fault injection: /dev/shm on learner rank 0's node is full."""
    from rlsys.errors import RunFailed
    from rlsys.placement import open_shared_weights

    ray = ray_cluster
    c = _controller(tmp_path, "noroom", "trainer.weight_sync=object_store")
    assert c.policies["policy"].shared is None

    def no_room(self):
        import actors.learner

        actors.learner.shm_free_bytes = lambda: 0  # where the learner looks it up

    ray.get(c.learners[0].__ray_call__.remote(no_room))
    c.cfg.trainer.weight_sync = "shared_memory"
    with pytest.raises(RunFailed) as err:
        open_shared_weights(c.cfg, c.policies)
    assert re.fullmatch(
        r"trainer.weight_sync=shared_memory for policy 'policy': /dev/shm has 0.0 MiB free, the weights "
        r"need [\d.]+ MiB \(two copies\) with 25% to spare \(use trainer.weight_sync=auto or object_store\)",
        str(err.value),
    ), str(err.value)
    c.cfg.trainer.weight_sync = "auto"
    open_shared_weights(c.cfg, c.policies)
    assert c.policies["policy"].shared is None  # auto: the object store instead
    c.sync_weights(1)
    c.ctx.settle_sync()
    learner = ray.get(c.learners[0].weights.remote())
    assert all(np.array_equal(_served(ray, c.workers[0])[k], learner[k]) for k in learner)
    c.shutdown()
