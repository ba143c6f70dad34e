"""Checkpoints and shipped models.

A model is two files side by side: ``<name>.pt`` (torch state: network weights and, for a resumable
training checkpoint, optimiser state, step counter, RNG states and the replay buffer) and ``<name>.json``
(metadata a person or a service reads without torch: agent, environment, data slice, seed,
hyper-parameters, input shape, evaluation figures, training time). Services read the JSON first to decide
whether the model fits their fleet, then load only the weights. The two files cannot be replaced in one step,
so the JSON records the sha256 of the ``.pt`` it describes (`PT_DIGEST`) and `load_state` refuses a ``.pt``
of another digest, naming both files: new weights under old metadata (or the reverse) are never served or
resumed. A JSON without the digest (written before it existed, as the shipped models) is taken as it is.

A trainer's resumable state (`Resumable`) is such a pair too; its JSON also records the run it belongs to
(`RUN_KEY`: agent, seed, data flags, hyper-parameters), so that ``--resume`` continues only that run.

Shipped models live in the repository's ``models/`` folder; ``HSCHED_MODELS_DIR`` points elsewhere.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import time
import zipfile
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


PT_DIGEST = "pt_sha256"  # the metadata key of the .pt's sha256


def _digest(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def save(path: str | Path, state: dict[str, Any], metadata: dict[str, Any]) -> Path:
    """Write ``path`` (.pt) and its ``.json`` sidecar, each atomically (temp file + rename), the JSON with the
    .pt's digest: a killed trainer never leaves a half-written file, nor a pair that `load_state` accepts.
    The JSON is renamed first: a kill before the .pt's rename leaves the weights it describes at .pt.tmp,
    where `load_state` finds them (the old .pt would be refused)."""
    path = Path(path).with_suffix(".pt")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    meta_tmp = path.with_suffix(".json.tmp")
    meta_tmp.write_text(json.dumps({**metadata, PT_DIGEST: _digest(tmp)}, indent=2, sort_keys=True,
                                   default=_jsonable) + "\n")
    meta_tmp.replace(path.with_suffix(".json"))
    tmp.replace(path)
    return path


def load_metadata(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).with_suffix(".json").read_text())


def load_state(path: str | Path) -> dict[str, Any]:
    """The torch state of a checkpoint, on the CPU: the .pt its .json describes (at .pt.tmp after a save killed
    between its renames), else ModelMismatch naming both files (a service falls back on it). ``weights_only=
    False`` because resumable checkpoints carry NumPy replay buffers and RNG states; only load checkpoints you
    or this project wrote."""
    path = Path(path).with_suffix(".pt")
    meta = path.with_suffix(".json")
    from hsched.policies.learned import ModelMismatch  # (learned imports this module)

    want = load_metadata(path).get(PT_DIGEST) if meta.exists() else None
    blob = path.read_bytes()
    if want is not None and hashlib.sha256(blob).hexdigest() != want:
        pending = path.with_suffix(".pt.tmp")
        blob = pending.read_bytes() if pending.exists() else b""
        if hashlib.sha256(blob).hexdigest() != want:
            raise ModelMismatch(f"{path} is not the weights {meta} describes (sha256 differs): the pair was not "
                                "written together; retrain, or restore both files")
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        # a truncated or foreign file (no digest to tell): a service falls back, a command says so in one line
        raise ModelMismatch(f"{path} is not a readable checkpoint ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None


def runs_dir(out: Path) -> Path:
    """Where training state and comparison runs of the model `out` go: the repository's runs/ (not
    shipped, git-ignored) for a model in models/, else next to `out`."""
    return models_dir().parent / "runs" if out.parent.resolve() == models_dir().resolve() else out.parent


def training_path(out: Path) -> Path:
    """The resumable training state of the model `out` (`Resumable`)."""
    return runs_dir(out) / f"{out.stem}.train.pt"


RUN_KEY = "run"  # the metadata key of the run a resumable state belongs to (training.run_identity)
MAX_LISTED = 4  # differences a refused --resume names


def _flat(run: Mapping[str, Any]) -> dict[str, str]:
    """A run record as flag → shown value (hyper-parameters one by one), JSON-encoded so that a record read
    back from a file compares equal to the one computed now."""
    out = {}
    for key, value in run.items():
        for k, v in (value.items() if key == "hyperparameters" else [(key, value)]):
            label = f"hyper-parameter {k}" if key == "hyperparameters" else k
            out[label] = ("(default)" if v is None else v if isinstance(v, str)
                          else json.dumps(v, sort_keys=True, default=_jsonable))
    return out


def _listed(items: list[str]) -> str:
    items = items[:MAX_LISTED] + ([f"{len(items) - MAX_LISTED} more"] if len(items) > MAX_LISTED else [])
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


class Resumable:
    """A trainer's resumable state at `path`: the run it belongs to, when it is written, and the checks of
    ``--resume``.

    `run` (`hsched.rl.training.run_identity`) is recorded in the JSON; `check` / `load` refuse, naming
    --resume (exit 2), a file that is missing or recorded another run (data, seed, hyper-parameters), before
    any training: continuing it would mix two runs under one metadata. Besides the save at the end, a trainer
    offers a save at each episode boundary, taken when `due` (`every_s` seconds since the last one): a killed
    run loses at most that much training plus an episode, and a run shorter than `every_s` writes nothing
    more. The state saved at an episode boundary holds everything the run needs to go on (nets, optimiser,
    replay, counters, RNG states), so a resume continues bit-identically, whichever save it starts from.

    `final`: the model file that also holds the finished run's state (the path agents keep it there): a
    resume reads `path` when a killed run left it there, else `final`; `save(..., final=True)` writes `final`
    and removes `path`."""

    def __init__(self, path: Path, run: Mapping[str, Any], every_s: float, final: Path | None = None) -> None:
        self.path, self.run, self.every_s, self.final = path.with_suffix(".pt"), dict(run), every_s, final
        self._last = time.monotonic()

    def source(self) -> Path:
        """The file a resume reads."""
        if self.final is not None and not self.path.exists() and self.final.exists():
            return self.final
        return self.path

    def check(self) -> Path:
        """The file ``--resume`` continues, once it exists and records this run (ValidationError otherwise)."""
        from hsched.domain.errors import ValidationError

        src = self.source()
        if not src.exists():
            where = f"{self.path} nor {self.final}" if self.final is not None else str(src)
            raise ValidationError("--resume", f"nothing to resume: no training checkpoint at {where}; train "
                                              "without --resume to start one")
        meta = src.with_suffix(".json")
        recorded = load_metadata(src).get(RUN_KEY) if meta.exists() else None
        if recorded is None:  # written before runs were recorded: nothing to compare
            return src
        was, now = _flat(recorded), _flat(self.run)
        differ = [k for k in dict.fromkeys([*was, *now]) if was.get(k) != now.get(k)]
        if differ:
            trained = _listed([f"{k} {was.get(k, '(none)')}" for k in differ])
            asks = " ".join(f"{k} {now.get(k, '(none)')}" for k in differ[:MAX_LISTED])
            raise ValidationError("--resume", f"{src} was trained with {trained}; this run asks {asks}"
                                              f"{' …' if len(differ) > MAX_LISTED else ''}")
        return src

    def load(self) -> dict[str, Any]:
        """The state ``--resume`` continues (`check`; a .pt its .json does not describe is refused too)."""
        from hsched.domain.errors import ValidationError
        from hsched.policies.learned import ModelMismatch

        src = self.check()
        try:
            return load_state(src)
        except ModelMismatch as exc:
            raise ValidationError("--resume", str(exc)) from None

    def load_into(self, modules: Mapping[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        """`load`, restoring what `save_modules` wrote into `modules` and `rng`; returns the saved progress."""
        saved = self.load()
        for key, module in modules.items():
            module.load_state_dict(saved[key])
        restore_rng_state(rng, saved["rng"])
        return saved

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.every_s

    def save(self, state: dict[str, Any], metadata: dict[str, Any], final: bool = False) -> None:
        save(self.final if final else self.path, state, {**metadata, RUN_KEY: self.run})
        if final:
            for stale in (self.path, self.path.with_suffix(".json")):
                stale.unlink(missing_ok=True)
        self._last = time.monotonic()

    def save_modules(self, modules: Mapping[str, Any], rng: np.random.Generator, progress: Mapping[str, Any],
                     metadata: dict[str, Any]) -> None:
        """Each module's (network's, optimiser's) state_dict under its key, the RNG states under "rng", and the
        trainer's `progress` (counters, curves, … as they are)."""
        self.save({**{k: m.state_dict() for k, m in modules.items()}, **progress, "rng": rng_state(rng)}, metadata)
