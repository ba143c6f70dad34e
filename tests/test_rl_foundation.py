"""The shared RL plumbing: networks, checkpoints, learning curves, the train registry, learned-policy loading."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hsched.domain.cluster import ClusterState
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import load_fleet
from hsched.domain.resources import Resources
from hsched.policies.base import select
from hsched.policies.heuristics import POLICY_NAMES, make_policy
from hsched.policies.learned import MODELS, Fallback, ModelMismatch
from hsched.rl import checkpoint
from hsched.rl.ddqn import DdqnConfig
from hsched.rl.nets import PooledScorer, SelfAttentionScorer
from hsched.rl.training import TRAINERS, TrainArgs, plot_curves, run_identity, smooth, trainer
from tests.conftest import SMALL_FLEET

TINY_CONFIG = DdqnConfig(steps=10, lr=1e-3)


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
    digest = hashlib.sha256(path.read_bytes()).hexdigest()  # the .pt it describes
    assert checkpoint.load_metadata(path) == {"agent": "x", "seed": 3, "pt_sha256": digest}
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


# -- a checkpoint's .pt and .json are one pair; --resume continues only the run it names ------------------------


def test_an_unreadable_checkpoint_is_a_model_mismatch_naming_it(tmp_path):
    """A truncated or foreign .pt without a digest to tell (a shipped model's pair): ModelMismatch in one line,
    which a serving placer falls back on and an eval reports, instead of torch's traceback."""
    path = checkpoint.save(tmp_path / "m", {"step": 1, "w": torch.zeros(1000)}, {})
    meta = checkpoint.load_metadata(path)
    del meta[checkpoint.PT_DIGEST]
    path.with_suffix(".json").write_text(json.dumps(meta))
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(ModelMismatch, match=rf"^{path} is not a readable checkpoint \("):
        checkpoint.load_state(path)
    path.write_text("not a checkpoint")
    with pytest.raises(ModelMismatch, match="is not a readable checkpoint"):
        checkpoint.load_state(path)


def test_a_pt_its_json_does_not_describe_is_refused_naming_both_files(tmp_path):
    old = checkpoint.save(tmp_path / "m", {"step": 1}, {"input_shape": 9})
    (tmp_path / "x.pt").write_bytes(old.read_bytes())
    new = checkpoint.save(tmp_path / "new", {"step": 2}, {"input_shape": 17})
    (tmp_path / "m.pt").write_bytes(new.read_bytes())  # new weights under old metadata (only the .pt replaced)
    with pytest.raises(ModelMismatch, match=rf"^{old} is not the weights {old.with_suffix('.json')} describes "
                                            r"\(sha256 differs\)"):
        checkpoint.load_state(old)
    (tmp_path / "m.json").write_text(new.with_suffix(".json").read_text())  # new json, old weights
    (tmp_path / "m.pt").write_bytes((tmp_path / "x.pt").read_bytes())
    with pytest.raises(ModelMismatch, match="is not the weights"):
        checkpoint.load_state(old)
    # a save killed between its renames (the json first): the weights the json describes are still at .pt.tmp
    (tmp_path / "m.pt.tmp").write_bytes(new.read_bytes())
    assert checkpoint.load_state(old)["step"] == 2
    (tmp_path / "m.pt.tmp").unlink()
    (tmp_path / "m.pt").write_bytes(new.read_bytes())  # both new: one pair again
    assert checkpoint.load_state(old)["step"] == 2
    meta = checkpoint.load_metadata(old)
    del meta[checkpoint.PT_DIGEST]  # a pair written before the digest is taken as it is (the shipped models)
    (tmp_path / "m.json").write_text(json.dumps(meta))
    (tmp_path / "m.pt").write_bytes((tmp_path / "x.pt").read_bytes())
    assert checkpoint.load_state(old)["step"] == 1


@pytest.mark.parametrize("path", sorted(checkpoint.models_dir().glob("*.pt")), ids=lambda p: p.stem)
def test_the_shipped_models_load_as_they_are(path):
    assert checkpoint.load_state(path)


def test_a_service_serves_no_weights_its_metadata_does_not_describe(tmp_path, monkeypatch):
    shipped = checkpoint.models_dir() / "double_dqn_dc.pt"
    state, meta = checkpoint.load_state(shipped), checkpoint.load_metadata(shipped)
    monkeypatch.setenv(checkpoint.MODELS_ENV, str(tmp_path))
    checkpoint.save(tmp_path / "double_dqn_dc.pt", state, meta)
    dc = next(d for d in load_fleet().datacenters if not d.node_table().gpu_count.any())
    assert not isinstance(make_policy("double-dqn", 0, dc), Fallback)
    torch.save({"q": {k: v + 1 for k, v in state["q"].items()}}, tmp_path / "double_dqn_dc.pt")  # json not replaced
    policy = make_policy("double-dqn", 0, dc)
    assert isinstance(policy, Fallback) and "is not the weights" in policy.name and "double_dqn_dc.json" in policy.name


def test_resume_needs_a_checkpoint_of_this_run(tmp_path):
    a = TrainArgs(seed=1, trace="kth", steps=10)
    run = run_identity(a, "x", TINY_CONFIG, ignore=("steps",))
    resumable = checkpoint.Resumable(tmp_path / "x_resume.pt", run, every_s=60)
    with pytest.raises(ValidationError, match=rf"^--resume: nothing to resume: no training checkpoint at "
                                              rf"{tmp_path / 'x_resume.pt'}; train without --resume"):
        resumable.check()
    resumable.save({"step": 10}, {"agent": "x"})
    assert resumable.load()["step"] == 10
    # another budget is the same run, extended
    same = run_identity(dataclasses.replace(a, steps=20), "x", dataclasses.replace(TINY_CONFIG, steps=20), ("steps",))
    assert checkpoint.Resumable(tmp_path / "x_resume.pt", same, every_s=60).load()["step"] == 10
    other = run_identity(TrainArgs(seed=7, trace="thunder"), "x", TINY_CONFIG, ("steps",))
    with pytest.raises(ValidationError, match=rf"^--resume: {tmp_path / 'x_resume.pt'} was trained with --seed 1 "
                                              r"and --trace kth; this run asks --seed 7 --trace thunder$"):
        checkpoint.Resumable(tmp_path / "x_resume.pt", other, every_s=60).check()
    lr = run_identity(a, "x", dataclasses.replace(TINY_CONFIG, lr=0.5), ("steps",))
    with pytest.raises(ValidationError, match=r"was trained with hyper-parameter lr 0.001; this run asks "
                                              r"hyper-parameter lr 0.5$"):
        checkpoint.Resumable(tmp_path / "x_resume.pt", lr, every_s=60).check()
    # a fleet given by another relative path is the same file
    fleet = run_identity(dataclasses.replace(a, fleet=Path(SMALL_FLEET)), "x", TINY_CONFIG, ("steps",))
    checkpoint.Resumable(tmp_path / "f_resume.pt", fleet, every_s=60).save({"step": 1}, {})
    relative = Path(os.path.relpath(SMALL_FLEET))
    again = run_identity(dataclasses.replace(a, fleet=relative), "x", TINY_CONFIG, ("steps",))
    assert checkpoint.Resumable(tmp_path / "f_resume.pt", again, every_s=60).load()["step"] == 1


def test_a_resume_of_a_mismatched_pair_is_a_usage_error(tmp_path):
    run = run_identity(TrainArgs(seed=1), "x", TINY_CONFIG)
    resumable = checkpoint.Resumable(tmp_path / "x_resume.pt", run, every_s=60)
    resumable.save({"step": 10}, {})
    torch.save({"step": 11}, tmp_path / "x_resume.pt")
    with pytest.raises(ValidationError, match=r"^--resume: .*x_resume.pt is not the weights .*x_resume.json"):
        resumable.load()
