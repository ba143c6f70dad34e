"""The shipped GPU placement models as policy factories: what `hsched eval gpu` shows as learned rows and what
the GPU trainers compare a new model against (`paired_comparison(..., vs_shipped=True)`).

Here, not in hsched.eval.gpu, so the trainers never import the evaluation report. Models are loaded lazily,
by the factory: listing them needs neither torch nor stable-baselines3.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from hsched.envs.gpu import MultiClusterState
from hsched.policies.base import NodePolicy
from hsched.rl.checkpoint import load_metadata, model_path, models_dir

# label -> factory(view, seed) returning a NodePolicy whose scores(state, demand, mask) rank the flattened hosts
# of `view.fleet` (the actor's score per host)
PolicyFactory = Callable[[MultiClusterState, int], NodePolicy]
SHIPPED_MODELS = (("DDPG", "ddpg_gpu"), ("EADE-DDPG", "eade_ddpg_gpu"))
SB3_ALGOS = ("td3", "sac", "ppo")


def _shipped_factory(path: Path) -> PolicyFactory:
    def factory(view: MultiClusterState, seed: int) -> NodePolicy:
        from hsched.rl.ddpg import ActorPolicy, load_actor

        actor, state = load_actor(path)
        return ActorPolicy(actor, state["policy"], view)  # hosts see their own cluster, as in training

    return factory


def _trained_on(path: Path) -> str:
    """What a checkpoint's metadata says it was trained on, in a few words."""
    try:
        meta = load_metadata(path)
    except (OSError, ValueError) as exc:
        return f"no readable metadata: {exc}"
    data = meta.get("data") or {}
    return (f"trained on {data.get('trace', 'an unrecorded trace')}"
            + (f", fleet {data['fleet']}" if data.get("fleet") else "")
            + f", seed {meta.get('seed', '?')}, {meta.get('steps', '?')} steps")


def _sb3_factory(algo: str, path: Path) -> PolicyFactory:
    def factory(view: MultiClusterState, seed: int) -> NodePolicy:
        from hsched.rl.sb3 import load

        return load(algo, path, view)

    return factory


def shipped_gpu_policies() -> tuple[dict[str, PolicyFactory], list[str]]:
    """The shipped models present in models/ (label -> factory), and a note for each: the file served and what it
    was trained on, or why it is skipped."""
    policies: dict[str, PolicyFactory] = {}
    notes: list[str] = []
    for label, name in SHIPPED_MODELS:
        path = model_path(name)
        if path.exists():
            policies[label] = _shipped_factory(path)
            notes.append(f"{label} row: {path} ({_trained_on(path)})")
        else:
            notes.append(f"{label} row skipped: no model at {path} (`hsched train "
                         f"{name.removesuffix('_gpu').replace('_', '-')}`)")
    # stable-baselines3 rows (optional dependency, hsched.rl.sb3): only where both the package and a model exist
    have_sb3 = importlib.util.find_spec("stable_baselines3") is not None
    for algo in SB3_ALGOS:
        path = models_dir() / f"{algo}_gpu.zip"
        if not have_sb3:
            notes.append(f"{algo.upper()} (SB3) row skipped: stable-baselines3 is not installed "
                         "(pip install 'hsched[sb3]')")
        elif not path.exists():
            notes.append(f"{algo.upper()} (SB3) row skipped: no model at {path} (`python -m hsched.rl.sb3 {algo}`)")
        else:
            policies[f"{algo.upper()} (SB3)"] = _sb3_factory(algo, path)
    return policies, notes
