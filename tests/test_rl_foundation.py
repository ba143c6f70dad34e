"""The shared RL plumbing: networks, checkpoints, learning curves, the train registry, learned-policy loading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import load_fleet
from hsched.domain.resources import Resources
from hsched.policies.base import select
from hsched.policies.heuristics import POLICY_NAMES, make_policy
from hsched.policies.learned import MODELS, Fallback
from hsched.rl import checkpoint
from hsched.rl.nets import PooledScorer, SelfAttentionScorer
from hsched.rl.training import TRAINERS, plot_curves, smooth, trainer


@pytest.mark.parametrize("cls", [SelfAttentionScorer, PooledScorer])
def test_scorers_serve_any_item_count_and_are_permutation_equivariant(cls):
    torch.manual_seed(0)
    net = cls(item_features=3, task_features=2).eval()
    task = torch.rand(1, 2)
    for n in (1, 5, 40):
        items = torch.rand(1, n, 3)
        out = net(items, task)
        assert out.shape == (1, n)
        perm = torch.randperm(n)
        # the score of an item depends on the item and on the set, not on its position
        torch.testing.assert_close(net(items[:, perm], task), out[:, perm], atol=1e-5, rtol=1e-5)


def test_scorer_extra_per_item_input_changes_the_score():
    torch.manual_seed(0)
    net = PooledScorer(2, 1, extra_features=1)
    items, task = torch.rand(1, 4, 2), torch.rand(1, 1)
    a = net(items, task, torch.zeros(1, 4, 1))
    b = net(items, task, torch.ones(1, 4, 1))
    assert not torch.allclose(a, b)


def test_pooled_scorer_is_the_head_over_item_context_and_extra():
    torch.manual_seed(0)
    net = PooledScorer(2, 1, embed=4, hidden=(5,), extra_features=1)
    items, task, extra = torch.rand(2, 3, 2), torch.rand(2, 1), torch.rand(2, 3, 1)
    # the plain definition: every item's embedding ⧺ mean and max of all embeddings ⧺ its extra input
    h = torch.relu(net.embed(torch.cat([items, task.unsqueeze(1).expand(-1, 3, -1)], dim=-1)))
    context = torch.cat([h.mean(dim=1), h.amax(dim=1)], dim=-1).unsqueeze(1).expand(-1, 3, -1)
    expected = net.head(torch.cat([h, context, extra], dim=-1)).squeeze(-1)
    torch.testing.assert_close(net(items, task, extra), expected, atol=1e-6, rtol=1e-5)


def test_smooth_is_a_trailing_mean():
    np.testing.assert_allclose(smooth([1, 2, 3, 4], 2), [1.0, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(smooth([4, 0, 2], 3), [4.0, 2.0, 2.0])
    np.testing.assert_allclose(smooth([5, 6], 1), [5, 6])


def test_plot_curves_writes_a_png(tmp_path):
    out = plot_curves(tmp_path / "c.png", {"a": ([0, 1, 2], [0.0, 1.0, 0.5]), "b": ([0, 1], [1.0, 2.0])},
                      title="t", xlabel="x", ylabel="y", window=2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_roundtrip_and_metadata_sidecar(tmp_path):
    net = torch.nn.Linear(3, 2)
    path = checkpoint.save(tmp_path / "m", {"net": net.state_dict(), "step": 7}, {"agent": "x", "seed": 3})
    assert path.suffix == ".pt" and not list(tmp_path.glob("*.tmp"))
    state = checkpoint.load_state(path)
    assert state["step"] == 7
    torch.testing.assert_close(state["net"]["weight"], net.weight)
    assert checkpoint.load_metadata(path) == {"agent": "x", "seed": 3}
    assert json.loads(path.with_suffix(".json").read_text())["seed"] == 3


def test_model_path_resolves_shipped_names_under_the_models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(checkpoint.MODELS_ENV, str(tmp_path))
    assert checkpoint.model_path("per_dqn_path") == tmp_path / "per_dqn_path.pt"
    assert checkpoint.model_path("some/dir/x.pt") == checkpoint.Path("some/dir/x.pt")


def test_every_registered_trainer_resolves():
    for agent in TRAINERS:
        assert callable(trainer(agent))
    with pytest.raises(ValueError, match="agent: unknown agent 'nope'"):
        trainer("nope")


@pytest.mark.parametrize("name", list(MODELS))
def test_a_learned_policy_without_its_model_falls_back_and_says_why(name, tmp_path, monkeypatch):
    monkeypatch.setenv(checkpoint.MODELS_ENV, str(tmp_path))  # an empty models dir
    dc = load_fleet().datacenters[0]
    policy = make_policy(name, 0, dc)
    assert isinstance(policy, Fallback)
    assert name in policy.name and "no model at" in policy.name
    # it still serves: a real choice through the placer's select()
    state = ClusterState(dc)
    demand = Resources(cpu_milli=1000, memory_mib=1024)
    choice = select(policy, state, demand, state.feasible(demand))
    assert choice is not None and choice.node >= 0


def test_policy_names_list_learned_policies():
    assert {"double-dqn", "ddpg", "eade-ddpg"} <= set(POLICY_NAMES)
