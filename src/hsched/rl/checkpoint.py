"""Checkpoints and shipped models.

A model is two files side by side: ``<name>.pt`` (torch state: network weights and, for a resumable
training checkpoint, optimiser state, step counter, RNG states and the replay buffer) and ``<name>.json``
(metadata a person or a service reads without torch: agent, environment, data slice, seed,
hyper-parameters, input shape, evaluation figures, training time). Services read the JSON first to decide
whether the model fits their fleet, then load only the weights.

Shipped models live in the repository's ``models/`` folder; ``HSCHED_MODELS_DIR`` points elsewhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsched.rl.training import restore_rng_state, rng_state

MODELS_ENV = "HSCHED_MODELS_DIR"


def serve_on_one_thread() -> None:
    """Hold this (serving) process's torch to one intra-op thread. One served decision is a few small
    matmuls: a second thread saves nothing, and its OpenMP spin-waits take the cores the stack's other
    processes need (`hsched up --policy double-dqn --gpu-policy eade-ddpg --path-finder per-dqn --replay
    openb` on 2 cores: Submit p99 0.76-0.92 s with torch's default threads, 26-36 ms on one). numpy's BLAS
    cannot be limited from here (it reads its thread count when numpy is imported): every service's __main__
    holds it to one thread first (hsched.threads)."""
    torch.set_num_threads(1)


def models_dir() -> Path:
    """``$HSCHED_MODELS_DIR`` or the repository's ``models/`` (src/hsched/rl → repo root)."""
    env = os.environ.get(MODELS_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[3] / "models"


def model_path(name: str) -> Path:
    """The ``.pt`` file of a shipped model by name (e.g. ``per_dqn_path``), or a path given as is."""
    p = Path(name)
    if p.suffix == ".pt" or p.parent != Path("."):
        return p.with_suffix(".pt")
    return models_dir() / f"{name}.pt"


def _jsonable(x: Any) -> Any:
    if is_dataclass(x) and not isinstance(x, type):
        return asdict(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def save(path: str | Path, state: dict[str, Any], metadata: dict[str, Any]) -> Path:
    """Write ``path`` (.pt) and its ``.json`` sidecar atomically (temp file + rename), so a killed trainer
    never leaves a half-written checkpoint that a resume or a service would read."""
    path = Path(path).with_suffix(".pt")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    meta_tmp = path.with_suffix(".json.tmp")
    meta_tmp.write_text(json.dumps(metadata, indent=2, sort_keys=True, default=_jsonable) + "\n")
    meta_tmp.replace(path.with_suffix(".json"))
    return path


def load_metadata(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).with_suffix(".json").read_text())


def load_state(path: str | Path) -> dict[str, Any]:
    """The torch state of a checkpoint, on the CPU. ``weights_only=False`` because resumable checkpoints
    carry NumPy replay buffers and RNG states; only load checkpoints you or this project wrote."""
    return torch.load(Path(path).with_suffix(".pt"), map_location="cpu", weights_only=False)


def runs_dir(out: Path) -> Path:
    """Where training state and comparison runs of the model `out` go: the repository's runs/ (not
    shipped, git-ignored) for a model in models/, else next to `out`."""
    return models_dir().parent / "runs" if out.parent.resolve() == models_dir().resolve() else out.parent


def training_path(out: Path) -> Path:
    """The resumable training state of the model `out` (`save_training` / `load_training`)."""
    return runs_dir(out) / f"{out.stem}.train.pt"


def save_training(path: Path, modules: Mapping[str, Any], rng: np.random.Generator, progress: Mapping[str, Any],
                  metadata: dict[str, Any]) -> None:
    """A resumable training checkpoint: each module's (network's, optimiser's) state_dict under its key, the
    RNG states under "rng", and the trainer's `progress` (counters, curves, … as they are)."""
    save(path, {**{k: m.state_dict() for k, m in modules.items()}, **progress, "rng": rng_state(rng)}, metadata)


def load_training(path: Path, modules: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Restore what `save_training` wrote into `modules` and `rng`; returns the saved state (its progress)."""
    saved = load_state(path)
    for key, module in modules.items():
        module.load_state_dict(saved[key])
    restore_rng_state(rng, saved["rng"])
    return saved
