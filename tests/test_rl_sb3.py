"""Stable-Baselines3 rows of `hsched eval gpu` (hsched.rl.sb3): the shipped TD3/SAC/PPO models load through the
serving path and decide under the mask; the compact serving archive round-trips. Skipped without the optional
dependency (`pip install 'hsched[sb3]'`; the test extra installs it)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

from hsched.envs.gpu import GpuClusterEnv, paper000_datacenters, run_policy
from hsched.policies.learned import ModelMismatch
from hsched.rl import checkpoint
from hsched.rl import sb3 as hsb3


@pytest.fixture(scope="module")
def paper_env() -> GpuClusterEnv:
    return GpuClusterEnv(paper000_datacenters(), n_tasks=220)


@pytest.mark.parametrize("algo", hsb3.ALGOS)
def test_shipped_sb3_model_serves_through_the_eval_factory(algo, paper_env, monkeypatch):
    from hsched.eval import gpu

    monkeypatch.delenv(checkpoint.MODELS_ENV, raising=False)
    path = checkpoint.models_dir() / f"{algo}_gpu.zip"
    assert path.exists(), f"shipped model {path} is missing (`python -m hsched.rl.sb3 {algo}`)"
    meta = checkpoint.load_metadata(path)
    assert meta["seed"] == 0 and meta["steps"] > 0 and meta["train_seconds"] > 0
    assert meta["data"]["eval_seeds"] == [0, 1, 2] and meta["data"]["train_episode_seeds"].startswith("10000..")
    monkeypatch.setattr(gpu, "LEARNED_POLICIES", {})
    monkeypatch.setattr(gpu, "LEARNED_NOTES", [])
    gpu.register_shipped_models()
    label = f"{algo.upper()} (SB3)"
    assert label in gpu.LEARNED_POLICIES, gpu.LEARNED_NOTES
    policy = gpu.LEARNED_POLICIES[label](paper_env.view, 0)
    assert isinstance(policy, hsb3.SB3Policy)
    runs = [run_policy(paper_env, policy, seed=s).metrics for s in meta["data"]["eval_seeds"]]
    assert all(m["failed"] == 0 and 150 <= m["deployed"] <= 220 for m in runs)
    # the served policy decides as the trained one did: the figure recorded at training time comes back
    assert np.mean([m["deployed"] for m in runs]) == pytest.approx(meta["evaluation"]["deployed"])
    small = GpuClusterEnv(paper000_datacenters(3, 2), n_tasks=20)
    with pytest.raises(ModelMismatch, match="another size"):
        gpu.LEARNED_POLICIES[label](small.view, 0)


@pytest.mark.parametrize("algo", hsb3.ALGOS)
def test_serving_archive_round_trips_the_policy_scores(algo, tmp_path):
    env = GpuClusterEnv(paper000_datacenters(3, 2), n_tasks=20)
    wrapped = hsb3.ScoreVectorActions(env, continuous=algo != "ppo", deploy_bonus=10.0)
    n = env.view.hosts + 1
    original = hsb3.build_policy(algo, wrapped.codec.dim, n)
    path = hsb3.save_policy(algo, original, tmp_path / f"{algo}_gpu.zip")
    served = hsb3.load(algo, path, env.view)
    original.set_training_mode(False)
    reference = hsb3.SB3Policy(original, algo.upper(), env.view)
    env.reset(seed=5)
    task = env.current_task
    mask = np.ones(env.view.hosts, dtype=bool)
    got = served.scores(env.view.fleet, task.resources, mask)
    want = reference.scores(env.view.fleet, task.resources, mask)
    assert got.shape == (env.view.hosts,) and np.allclose(got, want)
    assert np.all(np.isfinite(got))
    result = run_policy(env, served, seed=1)
    assert result.metrics["failed"] == 0 and result.metrics["deployed"] > 0


def test_load_reads_sb3s_own_archive_too(tmp_path):
    import stable_baselines3

    env = GpuClusterEnv(paper000_datacenters(3, 2), n_tasks=20)
    wrapped = hsb3.ScoreVectorActions(env, continuous=True, deploy_bonus=10.0)
    model = stable_baselines3.TD3("MlpPolicy", wrapped, policy_kwargs={"net_arch": hsb3.NET}, device="cpu",
                                  seed=0)
    model.save(str(tmp_path / "full.zip"))
    policy = hsb3.load("td3", tmp_path / "full.zip", env.view)
    assert run_policy(env, policy, seed=0).metrics["failed"] == 0


def test_wrong_algo_or_inputs_are_a_model_mismatch(tmp_path):
    env = GpuClusterEnv(paper000_datacenters(3, 2), n_tasks=20)
    dim = hsb3.Codec(env.view.hosts, env.view.host_cluster).dim
    path = hsb3.save_policy("sac", hsb3.build_policy("sac", dim, env.view.hosts + 1), tmp_path / "m.zip")
    with pytest.raises(ModelMismatch, match="not a td3 policy"):
        hsb3.load("td3", path, env.view)


def test_training_episodes_never_use_sb3s_seed():
    """SB3 passes its global seed (0, an evaluation seed) to the first reset: the wrapper keeps to the
    training seeds 10 000 + k."""
    wrapped = hsb3.ScoreVectorActions(GpuClusterEnv(paper000_datacenters(3, 2), n_tasks=20), continuous=True,
                                      deploy_bonus=10.0)
    reference = GpuClusterEnv(paper000_datacenters(3, 2), n_tasks=20)
    wrapped.reset(seed=0)
    reference.reset(seed=hsb3.TRAIN_SEED0)
    assert [t.resources for t in wrapped.unwrapped.tasks] == [t.resources for t in reference.tasks]
    reference.reset(seed=0)
    assert [t.resources for t in wrapped.unwrapped.tasks] != [t.resources for t in reference.tasks]
