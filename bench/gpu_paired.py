"""Every shipped GPU placement model (DDPG, EADE-DDPG and, with stable-baselines3 installed, TD3/SAC/PPO) on the
50 held-out episodes of paper 000's setting, paired with the heuristics, the experts and each other.

    python bench/gpu_paired.py            # ~5 min on one core

Per model: tasks deployed (mean over seeds 0-49, never trained or tuned on) and the paired difference to each
other policy (mean ± standard error over the seeds; seeds better / equal / worse), then fragmentation (eq.27)
and GPU load variance (eq.28) against Utilization. The same numbers `hsched train` writes into each model's
JSON, in one table, so the README's figures can be rerun in one command.
"""

from __future__ import annotations

from hsched.eval import gpu
from hsched.rl.ddpg import Config, paired_comparison


def main() -> None:
    for note in gpu.LEARNED_NOTES:
        print(note)
    cfg = Config()
    for label, factory in gpu.LEARNED_POLICIES.items():
        paired = paired_comparison(lambda view, f=factory: f(view, 0), cfg, vs_shipped=True)
        print(f"\n{label}: deploys {paired['mean']['deployed']:.2f} of {cfg.n_tasks} on seeds {paired['seeds']}\n")
        print("| vs | theirs | Δ deployed | better/equal/worse |\n|---|---:|---:|---:|")
        for other, row in paired["vs"].items():
            if other == label:
                continue
            d = row["deployed"]
            b, e, w = d["better/equal/worse"]
            print(f"| {other} | {d['other']:.2f} | {d['diff']:+.2f} ± {d['se']:.2f} | {b}/{e}/{w} |", flush=True)
        frag, var = (paired["vs"]["Utilization"][k] for k in ("fragmentation", "gpu_load_variance"))
        print(f"\nvs Utilization: fragmentation {frag['diff']:+.4f} ± {frag['se']:.4f}, "
              f"GPU load variance {var['diff']:+.5f} ± {var['se']:.5f}")


if __name__ == "__main__":
    main()
