"""What every trainer shares: the `hsched train` registry, seeding, progress, learning curves.

A trainer is a function ``train(args: TrainArgs) -> dict`` in its agent's module, registered below by
import path so that `hsched train --help` does not import torch. It trains from scratch (or resumes
``args.out`` with ``args.resume``), writes the checkpoint + metadata (hsched.rl.checkpoint), a learning
curve PNG next to it, and returns the figures it evaluated (printed by the CLI and stored in the metadata).
While it trains, it also writes its resumable state at episode boundaries every `CHECKPOINT_SECONDS` of
training (hsched.rl.checkpoint.Resumable), so that a killed run can be resumed with little lost.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

# agent name → ("module:function", one-line help). Each module documents its algorithm and defaults.
TRAINERS: dict[str, tuple[str, str]] = {
    "dqn": ("hsched.rl.dqn:train_dqn", "uniform-replay DQN on hsched/Path-v0 (the PER-DQN baseline)"),
    "per-dqn": ("hsched.rl.dqn:train_per_dqn", "PER-DQN path agent for the selector (paper 003 §2.1)"),
    "double-dqn": ("hsched.rl.ddqn:train_double_dqn", "thermal-aware Double DQN for DC placement (paper 003)"),
    "ddpg": ("hsched.rl.ddpg:train_ddpg", "DDPG for GPU cluster placement (paper 000 baseline)"),
    "eade-ddpg": ("hsched.rl.ddpg:train_eade_ddpg", "EADE-DDPG: DDPG + expert demonstrations (paper 000)"),
    "eade-ddpg-shapes": ("hsched.rl.ddpg:train_eade_ddpg_shapes",
                         "EADE-DDPG trained on random GPU fleet shapes (hsched.envs.shapes; issue 17)"),
    "ba3c": ("hsched.rl.ba3c:train_ba3c", "action-branching A3C for Spark DAG scheduling (paper 004; --steps = episodes)"),
    "a3c": ("hsched.rl.ba3c:train_a3c", "single-head A3C, paper 004's baseline (--steps = episodes)"),
    "jobfusion": ("hsched.rl.jobfusion:train_jobfusion",
                  "JobFusion: GCN + policy gradient over slice types for co-located DAG jobs (paper 001)"),
    "decima-colocation": ("hsched.rl.jobfusion:train_decima_colocation",
                          "paper 001's Decima baseline: the same learner, uniform slices, no resource inputs"),
}


# seconds of training between two resumable checkpoints (--checkpoint-seconds). A save costs well under a
# second for every agent but double-dqn's full-size replay (~130 MB, about a second): < 2 % of the time, and
# a run shorter than this writes only its final state, as before
CHECKPOINT_SECONDS = 60.0

# agents whose trainer can start from a checkpoint's weights (`--init`) instead of from scratch
FINE_TUNABLE = ("ba3c", "a3c")


@dataclass(frozen=True)
class TrainArgs:
    seed: int = 0
    steps: int | None = None      # None: the agent's default budget
    out: Path | None = None       # the checkpoint path; None: <run_dir>/<model>.pt (output_path)
    run_dir: Path | None = None   # None: a new runs/<model>-<UTC time>/ (new_run_dir)
    resume: bool = False          # continue the training checkpoint at `out`
    compare: bool = False         # also train the paper's comparison runs and plot them together
    progress: bool = True
    fleet: Path | None = None     # --fleet: a fleet YAML (None: the trainer's default fleet)
    trace: str | None = None      # --trace NAME|PATH (hsched.traces.catalog; None: the trainer's default)
    cores_per_proc: int = 1       # --cores-per-proc for an SWF trace
    time_compression: float = 1.0  # --time-compression for an SWF trace
    init: Path | None = None      # --init: start from this checkpoint's weights (FINE_TUNABLE agents)
    checkpoint_seconds: float = CHECKPOINT_SECONDS  # --checkpoint-seconds: 0 = at every episode boundary


def new_run_dir(name: str, root: Path = Path("runs")) -> Path:
    """A fresh `runs/<name>-<UTC time>/` under the working directory (not created yet)."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    run, n = root / f"{name}-{stamp}", 1
    while run.exists():  # two trainings started in the same second
        n += 1
        run = root / f"{name}-{stamp}-{n}"
    return run


def output_path(args: TrainArgs, model: str) -> Path:
    """Where a trainer writes `model`: `args.out` as given, else `<run dir>/<model>.pt` — never a shipped
    model in models/ (which the stack serves) unless `--out models/<model>.pt` says so. The file keeps the
    model's name, so HSCHED_MODELS_DIR=<run dir> serves it."""
    return Path(args.out) if args.out else (args.run_dir or new_run_dir(model)) / f"{model}.pt"


def run_identity(args: TrainArgs, agent: str, config: Any, ignore: Sequence[str] = ()) -> dict[str, Any]:
    """What a resumable checkpoint records of its run, and ``--resume`` must ask again (checkpoint.Resumable):
    the agent, --seed, the data flags (the fleet's absolute path; the trace's catalogue name, else its absolute
    path, and its scaling) and the hyper-parameters: the dataclass `config` as run, without `ignore` (the
    budget, which a resume extends, and anything the data flags already name) and how often it checkpoints."""
    from dataclasses import asdict

    trace = None
    if args.trace:
        from hsched.traces import data_dir
        from hsched.traces.catalog import TRACES, resolve_trace

        path = resolve_trace(args.trace, args.cores_per_proc, time_compression=args.time_compression).path.resolve()
        trace = next((name for name, file in TRACES.items() if (data_dir() / file).resolve() == path), str(path))
    skip = {*ignore, "checkpoint_every"}
    return {"agent": agent, "--seed": args.seed, "--fleet": str(Path(args.fleet).resolve()) if args.fleet else None,
            "--trace": trace, "--cores-per-proc": args.cores_per_proc, "--time-compression": args.time_compression,
            "hyperparameters": {k: v for k, v in asdict(config).items() if k not in skip}}


def trainer(agent: str) -> Callable[[TrainArgs], dict[str, Any]]:
    try:
        target, _ = TRAINERS[agent]
    except KeyError:
        raise ValueError(f"agent: unknown agent {agent!r}; choose one of {', '.join(TRAINERS)}") from None
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def check_budget(steps: int, learning_starts: int, train_every: int) -> None:
    """Refuse a budget of `steps` env steps that ends before the first gradient update on the agent's own
    experience (the first step >= `learning_starts` that is a multiple of `train_every`): such a run would save
    an untrained model. A usage error naming --steps (exit 2), as the CLI's other bad flag values are."""
    from hsched.domain.errors import ValidationError

    first = -(-max(learning_starts, 1) // train_every) * train_every
    if steps < first:
        raise ValidationError("--steps", f"ends before the first gradient update, at env step {first} "
                              f"(learning_starts {learning_starts}, train_every {train_every}): give --steps "
                              f">= {first}", steps)


def seed_everything(seed: int) -> np.random.Generator:
    """Seed Python, NumPy and torch and make torch deterministic on the CPU (one thread: results then do
    not depend on the machine's core count, and two trainers on a 2-core machine don't fight)."""
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    return np.random.default_rng(seed)


def rng_state(rng: np.random.Generator) -> dict[str, Any]:
    """Everything a resumed run needs to continue the same random streams."""
    import torch

    return {"numpy": rng.bit_generator.state, "torch": torch.get_rng_state(), "python": random.getstate()}


def restore_rng_state(rng: np.random.Generator, state: Mapping[str, Any]) -> None:
    import torch

    rng.bit_generator.state = state["numpy"]
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def returns_to_go(rewards: Sequence[float]) -> np.ndarray:
    """Undiscounted return from each decision to the episode's end."""
    return np.cumsum(np.asarray(rewards, dtype=np.float64)[::-1])[::-1]


def time_baseline(times: Sequence[Sequence[float]], returns: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Decima's input-dependent baseline (Mao et al. ICLR'19) for a group of episodes of the same workload (jobs
    and arrivals): per episode and decision, the mean over the group of their return-to-go at that decision's
    wall-clock time. An episode's return-to-go at time t is its value at its last decision at or before t (its
    first value before its first decision). `times[e]` and `returns[e]`: episode e's decision times and returns."""
    curves = [(np.asarray(t), np.asarray(g)) for t, g in zip(times, returns, strict=True)]
    out = []
    for t, _ in curves:
        at = [g[np.clip(np.searchsorted(tj, t, side="right") - 1, 0, len(g) - 1)] for tj, g in curves]
        out.append(np.mean(at, axis=0))
    return out


@contextmanager
def progress(description: str, total: int, enabled: bool = True) -> Iterator[Callable[..., None]]:
    """A rich progress bar; yields ``advance(n=1, **fields)`` (fields, e.g. reward=…, show after the bar)."""
    if not enabled:
        yield lambda n=1, **fields: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}")) as bar:
        task = bar.add_task(description, total=total, status="")

        def advance(n: int = 1, **fields: Any) -> None:
            status = "  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
            bar.update(task, advance=n, **({"status": status} if fields else {}))

        yield advance


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far), same length as values."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0 or window <= 1:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_curves(path: str | Path, curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], *,
                title: str, xlabel: str, ylabel: str, window: int = 20) -> Path:
    """One PNG: per label, (x, y) raw in a light line and smoothed (trailing mean of `window`) on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, (x, y)) in enumerate(curves.items()):
        color = f"C{i}"
        ax.plot(x, y, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(x, smooth(y, window), color=color, label=f"{label} (mean of {window})")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
