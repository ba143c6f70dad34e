"""Random GPU fleet shapes (hsched.envs.shapes) and EADE-DDPG on fleets of any host count (issue 17 item 3): the
shape generator's validation and invariants, the held-out shapes file, padded training batches scoring like
unpadded ones, the actor on fleets of other sizes, and a tiny training run on random shapes."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.domain.errors import ValidationError
from hsched.envs.gpu import run_policy
from hsched.envs.shapes import (
    GPU_MODELS,
    FleetShape,
    HostType,
    host_draws,
    load_shapes,
    random_shape,
    shape_datacenters,
    shape_env,
    shape_gpus,
    shape_tasks,
    shape_tasks_per_episode,
)
from hsched.policies.fgd import openb_tasks
from hsched.rl import checkpoint
from hsched.rl.ddpg import Actor, ActorPolicy, Codec, Config, load_actor, train, training_envs
from hsched.rl.training import TrainArgs

HELD_OUT = list(load_shapes().values())


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(8, 256))
def test_random_shapes_are_valid_and_never_held_out(seed, max_hosts):
    shape = random_shape(seed, HELD_OUT, max_hosts=max_hosts)
    assert shape.signature() not in {s.signature() for s in HELD_OUT}
    assert 1 <= shape.hosts <= max(max_hosts, 1) and 1 <= len(shape.host_types) <= 3
    for h in shape.host_types:
        assert h.gpus in (1, 2, 4, 8) and 16 <= h.card_gib <= 80 and GPU_MODELS[h.model] == h.card_gib
    assert random_shape(seed, HELD_OUT, max_hosts=max_hosts) == shape  # seeded


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_shape_fleets_hold_exactly_the_drawn_hosts(seed):
    shape = random_shape(seed, HELD_OUT, max_hosts=48)
    dcs = shape_datacenters(shape, seed)
    hosts = host_draws(shape, seed)
    assert len(dcs) == shape.clusters and [dc.node_table().gpu_count.size for dc in dcs] == \
        [shape.hosts_per_cluster] * shape.clusters
    assert shape_gpus(dcs) == sum(h.gpus for h in hosts)
    assert {h.model for h in hosts} == set(shape.models)  # every host type present (enough hosts: ≥ 3)
    assert shape_tasks_per_episode(dcs) == max(20, round(220 * shape_gpus(dcs) / 128))


def test_model_constraints_only_name_models_that_can_host_the_task():
    shape = HELD_OUT[1]  # modern-mixed: 1-, 4- and 8-GPU hosts
    pool = openb_tasks()
    tasks = shape_tasks(shape, pool, seed=3)
    most = {m: max(h.gpus for h in shape.host_types if h.model == m) for m in shape.models}
    constrained = [t for t in tasks if t.gpu_models]
    gpu_tasks = [t for t in tasks if t.resources.gpu_count]
    assert 0.2 < len(constrained) / len(gpu_tasks) < 0.4  # model_constrained 0.3 of 7 000 GPU tasks
    for t in constrained:
        assert t.resources.gpu_count and 1 <= len(t.gpu_models) <= 2
        assert all(most[m] >= t.resources.gpu_count for m in t.gpu_models)
    assert all(not t.gpu_models for t in tasks if not t.resources.gpu_count)
    assert [t.resources for t in tasks] == [t.resources for t in pool]  # demands unchanged


@pytest.mark.parametrize(("change", "field"), [
    ({"gpus": 9}, "gpus"), ({"gpus": 0}, "gpus"), ({"card_gib": 8}, "card_gib"), ({"card_gib": 96}, "card_gib"),
    ({"cpu_cores": 0}, "cpu_cores"), ({"memory_gib": 0}, "memory_gib"), ({"share": 0}, "share"),
    ({"model": ""}, "model")])
def test_host_type_validation_names_the_field(change, field):
    good = {"gpus": 8, "model": "H800", "card_gib": 80, "cpu_cores": 192, "memory_gib": 2048}
    with pytest.raises(ValidationError) as err:
        HostType(**{**good, **change})
    assert err.value.field == field


def test_shape_validation_names_the_field(tmp_path):
    h = HostType(4, "L40", 48, 64, 512)
    with pytest.raises(ValidationError) as err:
        FleetShape("x", 0, 2, (h,))
    assert err.value.field == "clusters"
    with pytest.raises(ValidationError) as err:
        FleetShape("x", 2, 2, (h, dataclasses.replace(h, gpus=8, card_gib=24)))
    assert err.value.field == "host_types[1].card_gib"  # one card memory per model
    with pytest.raises(ValidationError) as err:
        FleetShape("x", 2, 2, (h,), model_constrained=1.5)
    assert err.value.field == "model_constrained"
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({"shapes": [{"name": "a", "clusters": 1, "hosts_per_cluster": 1, "colour": "red",
                                           "host_types": [dataclasses.asdict(h)]}]}))
    with pytest.raises(ValidationError) as err:
        load_shapes(bad)
    assert err.value.field == "shapes[0]"


def test_held_out_shapes_include_8_gpu_hosts_with_80_gib_cards():
    assert len(HELD_OUT) >= 3
    assert any(h.gpus == 8 and h.card_gib == 80 for s in HELD_OUT for h in s.host_types)
    assert len({s.hosts for s in HELD_OUT}) >= 3  # different host counts


def test_padded_batches_score_like_the_unpadded_fleet():
    torch.manual_seed(0)
    actor = Actor(16, 2)
    env = shape_env(HELD_OUT[0])
    obs, info = env.reset(seed=1)
    plain = Codec(env.view.hosts, env.view.host_cluster)
    padded = Codec(env.view.hosts, env.view.host_cluster, max_hosts=env.view.hosts + 9)
    items, task, mask = plain.decode(torch.from_numpy(plain.encode(obs, info["action_mask"])))
    p_items, p_task, p_mask, pad = padded.decode_padded(torch.from_numpy(padded.encode(obs, info["action_mask"])))
    with torch.no_grad():
        a, b = actor(items, task)[0], actor(p_items, p_task, pad)[0]
    h = env.view.hosts
    torch.testing.assert_close(b[:h], a[:-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b[-1], a[-1], rtol=1e-5, atol=1e-5)
    assert p_mask[0, :h].tolist() == mask[0, :-1].tolist() and p_mask[0, -1] == mask[0, -1]
    assert not p_mask[0, h:-1].any() and pad[0, h:-1].all() and not pad[0, :h].any()
    assert padded.to_env(padded.n - 1) == h and padded.from_env(h) == padded.n - 1 and padded.to_env(3) == 3


@pytest.mark.parametrize("shape", HELD_OUT, ids=lambda s: s.name)
def test_one_actor_places_on_fleets_of_any_host_count(shape):
    env = shape_env(shape, n_tasks=30)
    policy = ActorPolicy(Actor(16, 2), "eade-ddpg", env.view)
    result = run_policy(env, policy, seed=0)
    m = result.metrics
    assert m["deployed"] + m["judged"] + m["failed"] == 30 and m["failed"] == 0  # never a masked action


def test_tiny_training_run_on_random_shapes(tmp_path):
    cfg = Config(shapes=2, max_hosts=12, n_tasks=20, steps=300, batch_size=32, learning_starts=100, train_every=4,
                 buffer_size=2_000, expert_episodes=2, noise_steps=300, checkpoint_every=10_000, embed=16,
                 heads=2, pretrain_updates=20, fleet=(2, 2))
    envs = training_envs(cfg)
    assert len(envs) == 2 and all(e.view.hosts <= 12 for e in envs)
    out = tmp_path / "s.pt"
    result = train(cfg, TrainArgs(seed=0, out=out, progress=False), "eade-ddpg", "s")
    assert result["steps"] >= 300
    meta = checkpoint.load_metadata(out)
    assert "random fleet shapes" in meta["environment"]
    actor, _ = load_actor(out)
    for env in envs:  # the trained actor serves each training shape
        assert run_policy(env, ActorPolicy(actor, "eade-ddpg", env.view), seed=5).metrics["failed"] == 0
    np.testing.assert_equal(meta["hyperparameters"]["shapes"], 2)
