"""Paper 001's heuristic baselines for the co-location environment (`hsched.envs.colocation`).

Paper 001 §3.3.3 compares JobFusion with Decima (learned, `hsched.rl.jobfusion` with uniform slices), the
*shortest-task-first* strategy ("priority by the time each task stage needs to complete; shorter stages
first") and *random* scheduling ("pick a random schedulable task respecting the dependencies"). Both
heuristics here choose only the stage; the slice type is the smallest free one that fits (best fit) and
every pending instance that finds such a slice is launched — the paper leaves both unspecified for them.

The functions read the environment through its public views (`candidates`, `type_mask`, `jobs`), so they
take any object with those; they return the env's action triple (candidate, slice type, count level).
"""

from __future__ import annotations

from typing import Any

import numpy as np

COUNT_LEVELS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 1 << 30)  # instances per action; the last: all that fit
ALL_LEVEL = len(COUNT_LEVELS) - 1


def _best_fit_action(env: Any, c: int, mask: np.ndarray) -> tuple[int, int, int]:
    k = int(np.flatnonzero(mask[c])[0])  # types are ordered by size: the first free fitting one
    return c, k, ALL_LEVEL


def stage_remaining_s(env: Any, j: int, s: int) -> float:
    """Slice-seconds the stage still needs: its unfinished instances × one instance's duration."""
    st = env.jobs[j].stages[s]
    return (st.spec.num_tasks - st.done) * st.spec.duration_s


def sjf_action(env: Any) -> tuple[int, int, int]:
    """Shortest stage first: the candidate with the least remaining work (ties: earliest job, lowest stage)."""
    cands = env.candidates()
    mask = env.type_mask(cands)
    c = min(range(len(cands)), key=lambda i: (stage_remaining_s(env, *cands[i]), cands[i]))
    return _best_fit_action(env, c, mask)


def random_action(env: Any, rng: np.random.Generator) -> tuple[int, int, int]:
    """A uniformly random schedulable stage."""
    cands = env.candidates()
    mask = env.type_mask(cands)
    return _best_fit_action(env, int(rng.integers(len(cands))), mask)
