"""Cascade with its parties as Ray actors: one local Ray session for the module, few actors."""

from __future__ import annotations

import tempfile

import pytest
import torch

from rlsys.models import TinyModelSpec, build_tiny_model
from rlsys.privacy.cascade import c_delta_shards, cascade_forward
from rlsys.privacy.decoder import DecoderWeights

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=tempfile.mkdtemp(prefix="rlsys-privacy-ray-"),
        )
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def setup():
    model = build_tiny_model(TinyModelSpec(num_hidden_layers=2), seed=0).eval()
    ids = torch.randint(0, model.config.vocab_size, (8,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = model(ids[None], output_hidden_states=True)
    return DecoderWeights.from_hf(model), ids, hf


@pytest.mark.parametrize(
    "shards, hosts",
    [(c_delta_shards(8, 4, 1), None), (c_delta_shards(8, 2, 2), 2)],
    ids=["one-actor-per-party", "parties-on-2-actors"],
)
def test_ray_parties_reproduce_the_plain_model(ray_session, setup, shards, hosts):
    """2 compute + 3 attention parties on their own actors; 4 + 12 parties on 2 actors. The
    attention parties' recorded (q, k, v) come back equal to the in-process forward's."""
    w, ids, hf = setup
    out = cascade_forward(w, ids, shards, backend="ray", hosts=hosts)
    torch.testing.assert_close(out.logits, hf.logits[0], atol=1e-5, rtol=1e-5)
    for s, seen in zip(out.shards, out.views):
        for layer, rows in enumerate(seen):
            torch.testing.assert_close(rows, hf.hidden_states[layer][0][torch.tensor(s)], atol=1e-5, rtol=1e-5)
    local = cascade_forward(w, ids, shards)
    assert sorted(out.attention_views) == sorted(local.attention_views)
    for pair, seen in local.attention_views.items():
        for got, want in zip(out.attention_views[pair], seen):
            for x, y in zip(got, want):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_ray_hosts_must_be_positive(setup, ray_session):
    w, ids, _ = setup
    with pytest.raises(ValueError):
        cascade_forward(w, ids, c_delta_shards(8, 4, 2), backend="ray", hosts=0)
