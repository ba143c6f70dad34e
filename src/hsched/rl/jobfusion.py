"""JobFusion (paper 001): a GCN + policy-gradient scheduler of offline DAG stages onto container slices.

Environment: `hsched/Colocation-v0` (`hsched.envs.colocation`): nodes cut into Q slice types by the
connectivity-constrained clustering (Q = 6), Alibaba 2018 batch DAGs, tidal online tasks that preempt
offline instances, paper 001's overheads, reward −(t_k − t_{k−1})·J_k.

Policy (paper 001 §2.2, fig. 5). The jobs in the system are embedded by the project's one GCN
(`hsched.rl.gcn.DagGCN`: node embeddings e_v from the children up, DAG summaries y_i, the global summary z)
from each stage's attributes (`STAGE_FEATURES`: CPU and memory demand, instances, finished/pending
fractions, duration, remaining work, runnable). Three heads output the action triple:

- stage: p_v = p([x_v, e_v, y_i, z]) over the schedulable stages, softmax (eq. 5);
- slice type: a score per type from the type's size, free count and spare room over the stage's demand,
  with the chosen stage's [x_v, e_v, z], softmax over the types with a free slice that fits (masked);
- count: logits over `COUNT_LEVELS` from the stage and type inputs; levels that launch no more than a
  smaller level already would are masked.

Training (eq. 6-7, algorithm 1): REINFORCE. Each iteration runs `rollouts` episodes of the same workload
(same env seed; training seeds 10 000 + k, imitation seeds 20 000 + k) and weights log π(a_k | s_k) by the return-to-go minus a baseline b_k. Paper 001 takes
b_k as the mean over earlier rounds at step k; with rollouts of different lengths we use Decima's
equivalent: the mean over the iteration's rollouts of the return-to-go at the same wall-clock time (the
workload being identical, that mean is the expected return from that point). Advantages are divided by
their standard deviation; a small entropy bonus keeps exploration.

The **Decima** baseline of paper 001 §3.3.3 is the same learner with what the paper says Decima lacks:
no slice partition (`slicing="uniform"`: one container type sized for the largest demand) and no
resource-demand inputs (the CPU and memory columns are left out of the GCN's node features).

Warm start (ours, not the paper's): before the policy gradient, `bc_episodes` episodes of behaviour cloning
of shortest-stage-first on the same slices (Adam steps on the negative log-likelihood of its stage,
best-fit type and "all" count, every 32 decisions). REINFORCE from a random policy needs far more episodes than a few CPU minutes allow (an
untrained policy's average JCT is ~4× shortest-stage-first's); the Decima baseline gets the same warm start.

Budgets (one core, `torch.set_num_threads(1)`): training episodes are smaller than the evaluation ones
(`train_jobs` jobs vs the env default) so that the default `iterations` fit in a few minutes; the GCN
generalises across the number of jobs and stages. Training seeds 10 000 + k; evaluation seeds 0, 1, 2.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hsched.envs.colocation import STAGE_FEATURES, ColocationConfig, ColocationEnv, run_colocation_policy
from hsched.policies.colocation import COUNT_LEVELS, sjf_action
from hsched.rl import checkpoint, training
from hsched.rl.gcn import DagGCN, DagGraph, GraphBatch
from hsched.rl.training import (
    TrainArgs,
    output_path,
    plot_curves,
    progress,
    returns_to_go,
    run_identity,
    seed_everything,
)

TRAIN_SEED0 = 10_000
BC_SEED0 = 20_000
EVAL_SEEDS = (0, 1, 2)
RESOURCE_COLUMNS = (STAGE_FEATURES.index("cpu"), STAGE_FEATURES.index("memory"))
TYPE_FEATURES = 4


@dataclass(frozen=True)
class Config:
    iterations: int = 15               # policy updates (the `hsched train --steps` budget)
    rollouts: int = 4                  # episodes of one workload per update
    train_jobs: int = 20               # jobs per training episode
    lr: float = 3e-4                   # policy-gradient step
    bc_lr: float = 1e-3                # imitation step
    entropy_weight: float = 1e-2
    reward_scale: float = 1e-3         # rewards are seconds × jobs; scaled before the policy gradient
    hidden: int = 32
    resource_features: bool = True     # False: the Decima baseline (no CPU/memory inputs)
    slicing: str = "constrained"       # "uniform" for the Decima baseline
    q: int = 6                         # paper 001's Q
    checkpoint_every: int = 5  # iterations (also: --checkpoint-seconds, the end)
    bc_episodes: int = 30              # behaviour-cloning warm start from shortest-stage-first (0: none)
    env: ColocationConfig = field(default_factory=ColocationConfig)

    def env_config(self, num_jobs: int | None = None) -> ColocationConfig:
        return dataclasses.replace(self.env, slicing=self.slicing, q=self.q,
                                   num_jobs=self.env.num_jobs if num_jobs is None else num_jobs)


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden // 2),
                         nn.LeakyReLU(0.2), nn.Linear(hidden // 2, outputs))


class JobFusionNet(nn.Module):
    """GCN embeddings + the stage, slice-type and count heads."""

    def __init__(self, cfg: Config, seed: int | None = None) -> None:
        super().__init__()
        self.columns = [i for i in range(len(STAGE_FEATURES))
                        if cfg.resource_features or i not in RESOURCE_COLUMNS]
        f = len(self.columns)
        self.gcn = DagGCN(in_features=f, seed=seed)
        e = self.gcn.embed
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed + 1)
            self.stage_head = _mlp(f + 3 * e, cfg.hidden, 1)
            self.type_head = _mlp(f + 2 * e + TYPE_FEATURES, cfg.hidden, 1)
            self.count_head = _mlp(f + 3 * e + TYPE_FEATURES, cfg.hidden, len(COUNT_LEVELS))


def type_features(env: ColocationEnv, demand: tuple[float, float]) -> np.ndarray:
    """Per slice type: size (fraction of a node × 10), log free slices, spare room over the stage's demand."""
    cap = env.capacity
    sizes = env.types.sizes
    spare = ((sizes - np.asarray(demand)) / np.maximum(sizes, 1e-9)).mean(axis=1)
    free = env.free_counts()
    return np.column_stack([sizes[:, 0] / cap[0] * 10, sizes[:, 1] / cap[1] * 10, np.log1p(free) / 4,
                            spare]).astype(np.float32)


@dataclass
class Decision:
    action: tuple[int, int, int]
    log_prob: torch.Tensor
    entropy: torch.Tensor


def decide(net: JobFusionNet, env: ColocationEnv, info: dict[str, Any], *, greedy: bool,
           rng: np.random.Generator | None = None, forced: tuple[int, int, int] | None = None) -> Decision:
    """One action triple for the env's current decision point (sampled, or the most likely when greedy);
    with `forced`, that action (a count level above what can launch maps to the smallest equivalent one)
    and its log-probability (behaviour cloning)."""
    cands: list[tuple[int, int]] = info["candidates"]
    jobs = list(env.arrived)
    row_of = {j: d for d, j in enumerate(jobs)}
    graphs = [DagGraph(env.stage_features(j)[:, net.columns], env.job_edges(j)) for j in jobs]
    batch = GraphBatch.build([graphs], in_features=len(net.columns))
    out = net.gcn(batch)
    offsets = batch.node_offsets
    node_rows = torch.tensor([int(offsets[row_of[j]]) + s for j, s in cands], dtype=torch.int64)
    dag_rows = torch.tensor([row_of[j] for j, _ in cands], dtype=torch.int64)
    x = batch.x[node_rows]
    e = out.node[node_rows]
    y = out.dag[dag_rows]
    z = out.global_[0].expand(len(cands), -1)
    stage_logits = net.stage_head(torch.cat([x, e, y, z], dim=1)).squeeze(1)
    c, lp_c, h_c = _pick(stage_logits, torch.ones(len(cands), dtype=torch.bool), greedy, rng,
                         None if forced is None else forced[0])

    j, s = cands[c]
    stage = env.jobs[j].stages[s]
    tf = torch.from_numpy(type_features(env, stage.spec.demand))
    mask = torch.from_numpy(np.asarray(info["type_mask"][c], dtype=bool))
    xs = torch.cat([x[c], e[c], z[0]]).expand(env.q, -1)
    type_logits = net.type_head(torch.cat([xs, tf], dim=1)).squeeze(1)
    k, lp_k, h_k = _pick(type_logits, mask, greedy, rng, None if forced is None else forced[1])

    cap = min(stage.pending, len(env.free[k]))
    level_mask = torch.tensor([i == 0 or COUNT_LEVELS[i - 1] < cap for i in range(len(COUNT_LEVELS))])
    count_logits = net.count_head(torch.cat([x[c], e[c], y[c], z[0], tf[k]]).unsqueeze(0)).squeeze(0)
    want = None
    if forced is not None:
        want = min(forced[2], next(i for i, v in enumerate(COUNT_LEVELS) if v >= cap or i == len(COUNT_LEVELS) - 1))
    n, lp_n, h_n = _pick(count_logits, level_mask, greedy, rng, want)
    return Decision((c, k, n), lp_c + lp_k + lp_n, h_c + h_k + h_n)


def _pick(logits: torch.Tensor, mask: torch.Tensor, greedy: bool, rng: np.random.Generator | None,
          forced: int | None = None) -> tuple[int, torch.Tensor, torch.Tensor]:
    masked = logits.masked_fill(~mask, -1e9)
    logp = torch.log_softmax(masked, dim=0)
    p = logp.exp()
    if forced is not None:
        i = int(forced)
    elif greedy:
        i = int(torch.argmax(masked))
    else:
        probs = p.detach().numpy().astype(np.float64)
        probs = probs / probs.sum()
        i = int((rng or np.random.default_rng()).choice(len(probs), p=probs))
    entropy = -(p * logp).masked_fill(~mask, 0.0).sum()
    return i, logp[i], entropy


def run_episode(net: JobFusionNet, env: ColocationEnv, seed: int, *, greedy: bool,
                rng: np.random.Generator | None = None, track: bool = False) -> dict[str, Any]:
    """One episode; with `track`, the per-decision log-probs, entropies, rewards and times for training."""
    _, info = env.reset(seed=seed)
    logps, ents, rewards, times = [], [], [], []
    done = False
    while not done:
        times.append(env.t)
        with torch.set_grad_enabled(track):
            d = decide(net, env, info, greedy=greedy, rng=rng)
        _obs, r, term, trunc, info = env.step(d.action)
        done = term or trunc
        if track:
            logps.append(d.log_prob)
            ents.append(d.entropy)
            rewards.append(r)
    return {"metrics": info["metrics"], "logps": logps, "entropies": ents, "rewards": rewards, "times": times}


def imitation_episode(net: JobFusionNet, env: ColocationEnv, seed: int, optim: torch.optim.Optimizer,
                      batch: int = 32) -> float:
    """Behaviour cloning along one shortest-stage-first episode: an Adam step on the mean negative
    log-likelihood of every `batch` of its decisions. Returns the episode's mean NLL."""
    _, info = env.reset(seed=seed)
    nll: list[torch.Tensor] = []
    total, count, done = 0.0, 0, False
    while not done:
        expert = sjf_action(env)
        d = decide(net, env, info, greedy=True, forced=expert)
        nll.append(-d.log_prob)
        _obs, _r, term, trunc, info = env.step(d.action)
        done = term or trunc
        if len(nll) == batch or (done and nll):
            loss = torch.stack(nll).mean()
            optim.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 10.0)
            optim.step()
            total += float(loss.detach()) * len(nll)
            count += len(nll)
            nll = []
    return total / max(count, 1)


def time_baseline(rollouts: list[dict[str, Any]]) -> list[np.ndarray]:
    """Per rollout and step, the mean over the rollouts of the return-to-go at that step's time
    (`hsched.rl.training.time_baseline`)."""
    return training.time_baseline([ro["times"] for ro in rollouts], [returns_to_go(ro["rewards"]) for ro in rollouts])


class JobFusionPolicy:
    """A trained JobFusion/Decima net acting greedily on a `ColocationEnv` (evaluation and serving)."""

    def __init__(self, net: JobFusionNet, name: str) -> None:
        self.net, self.name = net.eval(), name

    def __call__(self, env: ColocationEnv) -> tuple[int, int, int]:
        info = {"candidates": env.candidates()}
        info["type_mask"] = env.type_mask(info["candidates"])
        with torch.no_grad():
            return decide(self.net, env, info, greedy=True).action


def load_policy(path: str | Path) -> tuple[JobFusionPolicy, Config]:
    """The shipped (or given) model: weights + the Config it was trained with (from the metadata)."""
    meta = checkpoint.load_metadata(checkpoint.model_path(str(path)))
    hp = dict(meta["hyperparameters"])
    hp["env"] = ColocationConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in hp["env"].items()})
    cfg = Config(**hp)
    net = JobFusionNet(cfg)
    net.load_state_dict(checkpoint.load_state(checkpoint.model_path(str(path)))["net"])
    return JobFusionPolicy(net, meta["agent"]), cfg


def evaluate(policy: Any, env: ColocationEnv, seeds: tuple[int, ...] = EVAL_SEEDS) -> dict[str, float]:
    """Mean metrics of a policy (callable env → action) over `seeds`."""
    rows = [run_colocation_policy(env, policy, seed) for seed in seeds]
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def train(cfg: Config, args: TrainArgs, name: str, model: str) -> dict[str, Any]:
    out = output_path(args, model)
    iterations = args.steps or cfg.iterations
    cfg = dataclasses.replace(cfg, iterations=iterations)
    resume = checkpoint.Resumable(checkpoint.training_path(out), run_identity(args, name, cfg, ("iterations",)),
                                  args.checkpoint_seconds)
    if args.resume:
        resume.check()
    rng = seed_everything(args.seed)
    net = JobFusionNet(cfg, seed=args.seed)
    optim = torch.optim.Adam(net.parameters(), lr=cfg.bc_lr)
    train_env = ColocationEnv(cfg.env_config(cfg.train_jobs))
    it, seconds, curves = 0, 0.0, {"iteration": [], "avg_jct_s": [], "return": []}
    trained = {"net": net, "optim": optim}
    if args.resume:
        saved = resume.load_into(trained, rng)
        it, seconds, curves = saved["iteration"], saved["seconds"], saved["curves"]
    t0, cpu0 = time.perf_counter() - seconds, time.process_time()
    if not args.resume and cfg.bc_episodes:
        with progress(f"{name}: imitation of shortest-stage-first", cfg.bc_episodes, args.progress) as advance:
            for episode in range(cfg.bc_episodes):
                advance(1, nll=imitation_episode(net, train_env, BC_SEED0 + 1000 * args.seed + episode, optim))
    for group in optim.param_groups:
        group["lr"] = cfg.lr
    with progress(name, iterations, args.progress) as advance:
        advance(it)
        while it < iterations:
            seed = TRAIN_SEED0 + 1000 * args.seed + it
            rollouts = [run_episode(net, train_env, seed, greedy=False, rng=rng, track=True)
                        for _ in range(cfg.rollouts)]
            baselines = time_baseline(rollouts)
            advs = []
            for ro, b in zip(rollouts, baselines, strict=False):
                advs.append((returns_to_go(ro["rewards"]) - b) * cfg.reward_scale)
            scale = float(np.std(np.concatenate(advs))) + 1e-6
            loss = torch.zeros(())
            steps = sum(len(ro["logps"]) for ro in rollouts)
            for ro, adv in zip(rollouts, advs, strict=False):
                lp = torch.stack(ro["logps"])
                ent = torch.stack(ro["entropies"])
                loss = loss - (lp * torch.from_numpy(adv / scale).float()).sum() / steps \
                    - cfg.entropy_weight * ent.sum() / steps
            optim.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 10.0)
            optim.step()
            it += 1
            jct = float(np.mean([ro["metrics"]["avg_jct_s"] for ro in rollouts]))
            ret = float(np.mean([sum(ro["rewards"]) for ro in rollouts]))
            curves["iteration"].append(it)
            curves["avg_jct_s"].append(jct)
            curves["return"].append(ret)
            advance(1, jct=jct)
            if it % cfg.checkpoint_every == 0 or it >= iterations or resume.due():
                seconds = time.perf_counter() - t0
                resume.save_modules(trained, rng, {"iteration": it, "seconds": seconds, "curves": curves},
                                    {"agent": name, "model": str(out), "iteration": it})
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    eval_env = ColocationEnv(cfg.env_config())
    figures = evaluate(JobFusionPolicy(net, name), eval_env)
    sjf = evaluate(sjf_action, eval_env)
    meta = {"agent": name, "environment": "hsched/Colocation-v0 (paper 001)",
            "data": {"workload": cfg.env.workload, "trace": "alibaba_v2018_dags batch_task_6600_jobs",
                     "train_episode_seeds": f"{TRAIN_SEED0 + 1000 * args.seed}..{TRAIN_SEED0 + 1000 * args.seed + it - 1}",
                     "eval_seeds": list(EVAL_SEEDS)},
            "command": " ".join(["hsched", "train", name] + ([f"--seed {args.seed}"] if args.seed else [])
                                + ([f"--steps {args.steps}"] if args.steps else [])),
            "argv": " ".join(shlex.quote(a) for a in sys.argv),
            "seed": args.seed, "iterations": it, "hyperparameters": cfg, "stage_features":
                [STAGE_FEATURES[i] for i in net.columns],
            "slice_types": net_slice_types(eval_env),
            "evaluation": figures, "sjf_same_slices": sjf,
            "train_seconds": round(seconds, 1), "train_cpu_seconds": round(cpu, 1), "torch": torch.__version__}
    checkpoint.save(out, {"net": net.state_dict()}, meta)
    plot_curves(out.with_suffix(".png"), {f"{name}: average JCT (s)": (curves["iteration"], curves["avg_jct_s"])},
                title=f"{name} on Colocation-v0 (paper 001, {cfg.train_jobs} jobs/episode)",
                xlabel="policy update", ylabel="average JCT of the update's rollouts (s)", window=5)
    return {"model": str(out), "iterations": it, "train_seconds": round(seconds, 1),
            "train_cpu_seconds": round(cpu, 1), **{f"eval_{k}": v for k, v in figures.items()},
            **{f"sjf_{k}": v for k, v in sjf.items() if k in ("avg_jct_s", "utilisation")}}


def net_slice_types(env: ColocationEnv) -> dict[str, Any]:
    return {"sizes": env.types.sizes.round(4).tolist(), "per_node": list(env.per_node), "nodes": env.cfg.nodes}


def train_jobfusion(args: TrainArgs) -> dict[str, Any]:
    """JobFusion: constrained slice types (Q = 6) and resource-aware stage features."""
    return train(Config(), args, "jobfusion", "jobfusion_colocation")


def train_decima_colocation(args: TrainArgs) -> dict[str, Any]:
    """Paper 001's Decima baseline: the same learner on uniform slices, without resource inputs."""
    return train(Config(slicing="uniform", resource_features=False), args, "decima-colocation",
                 "decima_colocation")

