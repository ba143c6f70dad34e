"""`hsched eval thermal`: paper 003 table 5 and fig.9 — placement inside one DC, with the room's thermal model.

Setup (the same for every policy and seed)
-------------------------------------------
* Room: "chicago" of the default fleet, paper 003 §3.2.2's 16 racks × 42 1U servers × 24 cores, 100 W idle /
  300 W full, recirculation matrix D from the room geometry (hsched.thermal). Environment:
  `hsched.envs.dc.DcPlacementEnv`; every policy acts through `run_policy`, i.e. the placer's own
  `plan()`/`select()` code.
* Jobs: LLNL Thunder. Jobs 0-1999 warm the room up: they are placed by round robin, so every policy starts from
  the same warmed-up room (paper: "the same initial state"). Then 500 evaluation jobs are played, shifted in
  time to follow the warm-up. Seed s plays the jobs 5000 + 500·s … 5499 + 500·s, so seed 0 is exactly the
  paper's split (2 000 warm-up, 3 000 training, 500 evaluation). The seed also seeds the Random policy.
  `ctx.quick`: 200 warm-up jobs and 50 evaluation jobs (seed s: jobs 500 + 50·s …).
* Two CRAC modes. "fixed": 20 °C supply air, as in the paper. In this mode PUE cannot depend on the placement:
  cooling power is P_IT / CoP(20 °C). "redline": the CRAC runs the warmest supply that keeps the hottest inlet
  at 27 °C, so hot spots cost cooling power. This is the only way PUE moves in our model.
* Metrics. Mean reward is per decision (eq.12, `RewardConfig` defaults). PUE, overloads (servers with
  u > 0.8) and mean rack outlet temperature are time-weighted over the evaluation window, from the first to
  the last decision. Each cell is the mean ± std over seeds. The Δ columns are per-seed differences against
  RR / Greedy on the same jobs: % for PUE and overloads, °C for the outlet (as the paper reports them).

Rows still to come plug into `POLICY_FACTORIES`; see the note there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from hsched.envs.dc import DEFAULT_DC, PAPER_SPLIT, DcPlacementEnv, RewardConfig, run_policy
from hsched.eval.report import EvalContext, markdown_table, mean_std, plot_lines
from hsched.policies.heuristics import make_policy

# Each row of the table is a factory: seed -> NodePolicy (it acts through plan/select, like the placer) or a
# callable (obs, action_mask) -> action (a learned agent). Hook for the rows still to come:
#   POLICY_FACTORIES["Double DQN"] = lambda seed: <load models/<checkpoint>, return act(obs, mask)>
#       the agent trained on the "train" phase of DcPlacementEnv (paper 003 §3.2.3);
#   POLICY_FACTORIES["Optimum"] = lambda seed: <callable that replays the exact optimum's actions>.
# run() picks them up with no other change.
POLICY_FACTORIES: dict[str, Callable[[int], Any]] = {
    "RR": lambda seed: make_policy("rr"),
    "Greedy": lambda seed: make_policy("greedy"),
    "BestFit": lambda seed: make_policy("bestfit"),
    "FirstFit": lambda seed: make_policy("firstfit"),
    "Random": lambda seed: make_policy("random", seed),
    "Utilization": lambda seed: make_policy("utilization"),
}

QUICK_SPLIT = (200, 300, 50)  # warm-up, train, eval jobs for ctx.quick
MODES = {
    "fixed": "Fixed 20 °C supply air (paper 003 setup)",
    "redline": "CRAC holding the hottest inlet at the 27 °C redline",
}
PAPER_DELTAS = {
    "pue": (-2.5, -1.7),
    "overloads": (-42.1, -13.2),
    "outlet": (-0.4, -0.2),
}  # DDQN vs RR, Greedy
METRICS = (
    ("mean_reward", "mean reward", 3),
    ("mean_pue", "mean PUE", 4),
    ("mean_overloads", "mean overloads", 2),
    ("mean_rack_outlet_c", "mean rack outlet °C", 3),
)
GRID_POINTS = 300


def _pct(x: float, ref: float) -> float:
    return (x - ref) / ref * 100.0 if ref else math.nan


def _cell(values: list[float], digits: int) -> str:
    finite = [v for v in values if math.isfinite(v)]
    return mean_std(finite, digits) if len(finite) == len(values) else "n/a (reference is 0)"


def _resample(times: np.ndarray, values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """A piecewise-constant series (value holds from its time on) sampled at `grid`."""
    idx = np.searchsorted(times, grid, side="right") - 1
    return values[np.clip(idx, 0, len(values) - 1)]


def run(ctx: EvalContext) -> str:
    split = QUICK_SPLIT if ctx.quick else PAPER_SPLIT
    warm, train, evaluation = split
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        m: {p: [] for p in POLICY_FACTORIES} for m in MODES
    }
    series: dict[str, dict[str, list[tuple[np.ndarray, dict[str, np.ndarray]]]]] = {
        m: {p: [] for p in POLICY_FACTORIES} for m in MODES
    }
    total, done = len(MODES) * len(ctx.seeds) * len(POLICY_FACTORIES), 0
    ctx.progress("thermal", 0, total)
    for mode in MODES:
        for seed in ctx.seeds:
            env = DcPlacementEnv(
                DEFAULT_DC,
                phase="eval",
                split=split,
                offset=seed * evaluation,
                supply_mode=mode,
                record_series=True,
            )
            for name, factory in POLICY_FACTORIES.items():
                results[mode][name].append(run_policy(env, factory(seed), seed=seed))
                hours = (np.asarray(env.series["time_s"]) - env.episode_t0) / 3600.0
                series[mode][name].append((hours, {k: np.asarray(v) for k, v in env.series.items()}))
                done += 1
                ctx.progress(f"thermal {mode} seed {seed} {name}", done, total)

    first = warm + train
    lines = [
        "## Paper 003 table 5 / fig.9: thermal-aware placement inside one data center",
        "",
        f"Room `{DEFAULT_DC}` of the default fleet: 16 racks × 42 servers × 24 cores, 100 W / 300 W. "
        f"LLNL Thunder: jobs 0-{warm - 1} warm the room up (placed by round robin; every policy starts from the "
        f"same state). Then {evaluation} evaluation jobs: seed s plays jobs {first} + {evaluation}·s onwards. "
        f"Seeds {list(ctx.seeds)} (they also seed Random). Eq.12 reward with the `RewardConfig` defaults "
        f"{_reward_text(RewardConfig())}. Mean reward is per decision. PUE, overloads (servers with u > 0.8) "
        "and rack outlet temperature are time-weighted over the evaluation window. Cells are mean ± std over "
        "seeds. The Δ columns are per-seed differences against RR and Greedy: % for PUE and overloads, °C "
        "for the outlet." + (" **Quick run: 200 warm-up and 50 evaluation jobs.**" if ctx.quick else ""),
    ]
    for mode, title in MODES.items():
        res = results[mode]
        rows = []
        for name, runs in res.items():
            rows.append(
                [
                    name,
                    *(_cell([r[key] for r in runs], digits) for key, _, digits in METRICS),
                    mean_std([r["placed"] for r in runs], 0),
                    mean_std([r["deferred"] for r in runs], 0),
                    mean_std([r["sim_hours"] for r in runs], 2),
                ]
            )
        lines += [
            "",
            f"### {title}",
            "",
            markdown_table(
                ["policy", *(label for _, label, _ in METRICS), "placed", "deferred", "hours"], rows
            ),
        ]
        delta_rows = []
        for name, runs in res.items():
            row: list[object] = [name]
            for key, unit in (("mean_pue", "%"), ("mean_overloads", "%"), ("mean_rack_outlet_c", "°C")):
                for ref in ("RR", "Greedy"):
                    refs = res[ref]
                    vals = [
                        (_pct(r[key], b[key]) if unit == "%" else r[key] - b[key])
                        for r, b in zip(runs, refs, strict=True)
                    ]
                    row.append(_cell(vals, 2 if unit == "%" else 3))
            delta_rows.append(row)
        delta_rows.append(
            ["paper: Double DQN", *(f"{v:+.1f}" for pair in PAPER_DELTAS.values() for v in pair)]
        )
        lines += [
            "",
            markdown_table(
                [
                    "policy",
                    "ΔPUE vs RR %",
                    "ΔPUE vs Greedy %",
                    "Δoverloads vs RR %",
                    "Δoverloads vs Greedy %",
                    "Δoutlet vs RR °C",
                    "Δoutlet vs Greedy °C",
                ],
                delta_rows,
            ),
        ]
        if mode == "fixed":
            pues = {round(r["mean_pue"], 9) for runs in res.values() for r in runs}
            if len(pues) == 1:
                lines += [
                    "",
                    f"With a fixed supply temperature every policy has the same PUE ({pues.pop():.4f}). "
                    "Here PUE = 1 + 1/CoP(20 °C) + 5 % other, whatever the placement. "
                    "The redline mode below is where placement changes PUE.",
                ]

    pngs = [
        _plot(
            ctx,
            series["fixed"],
            "mean_rack_outlet_c",
            "thermal_outlet.png",
            "Mean rack outlet temperature, fixed 20 °C supply (paper 003 fig.9)",
            "°C",
        ),
        _plot(
            ctx,
            series["redline"],
            "pue",
            "thermal_pue.png",
            "PUE over time, CRAC at the 27 °C redline",
            "PUE",
        ),
        _plot(
            ctx,
            series["redline"],
            "mean_rack_outlet_c",
            "thermal_outlet_redline.png",
            "Mean rack outlet temperature, CRAC at the 27 °C redline",
            "°C",
        ),
    ]
    lines += [
        "",
        "Rows to come: Double DQN (paper 003 §3.2.3) and the exact optimum, through "
        "`hsched.eval.thermal.POLICY_FACTORIES`.",
        "",
        "PNG files:",
        *(f"- {p}" for p in pngs),
    ]
    return "\n".join(lines) + "\n"


def _reward_text(rc: RewardConfig) -> str:
    return (
        f"(r_job {rc.r_job}, overheat −{rc.overheat_penalty} above the redline, overload −{rc.overload_penalty} "
        f"above u = {rc.phi_u}, no room −{rc.invalid_penalty})"
    )


def _plot(
    ctx: EvalContext,
    runs: dict[str, list[tuple[np.ndarray, dict[str, np.ndarray]]]],
    key: str,
    filename: str,
    title: str,
    ylabel: str,
) -> str:
    """Each policy's series averaged over seeds on a common grid of hours since the first evaluation decision."""
    span = min(float(h[-1]) for per_seed in runs.values() for h, _ in per_seed)
    grid = np.linspace(0.0, max(span, 1e-9), GRID_POINTS)
    lines = {}
    for name, per_seed in runs.items():
        stacked = np.stack([_resample(h, s[key], grid) for h, s in per_seed])
        lines[name] = (grid.tolist(), stacked.mean(axis=0).tolist())
    return str(
        plot_lines(ctx.png(filename), title, "hours since the first evaluation decision", ylabel, lines)
    )
