"""hsched eval colocation (paper 001): the comparison runs on the shipped models and the JCT lower bound
holds for every policy."""

from __future__ import annotations

import numpy as np

from hsched.envs.colocation import ColocationConfig, ColocationEnv
from hsched.eval import EXPERIMENTS
from hsched.eval.colocation import _lower_bound, comparison
from hsched.eval.report import EvalContext


def test_quick_alibaba_comparison_and_bound(tmp_path):
    ctx = EvalContext(seeds=[0], out_dir=tmp_path, quick=True)
    text, results = comparison(ctx, "alibaba")
    assert "JobFusion (constrained slices, Q=6)" in results and "random (uniform slices)" in results
    env = ColocationEnv(ColocationConfig(num_jobs=10))
    bound = _lower_bound(env, 0, len(env.slice_type))
    for label, per in results.items():
        assert per["avg_jct_s"][0] >= bound - 1e-6, label  # no policy beats the lower bound
        assert 0 < per["utilisation"][0] <= 1
    assert "lower bound" in text and "colocation" in EXPERIMENTS


def test_lower_bound_of_one_job_by_hand():
    from hsched.envs.colocation import JobSpec, StageSpec

    job = JobSpec("w", (StageSpec(10, 4.0, (1.0, 1.0)),))
    env = ColocationEnv(pool=[job], nodes=1, node_capacity=(2.0, 2.0), q=1, num_jobs=1, online_rate=0.0,
                        sched_delay_s=(0.5,), container_start_s=(1.0, 1.0))
    # critical path 0.5 + 1 + 4 = 5.5; slice-seconds 10 × (1 + 4) = 50 over 2 slices = 25, + 0.5 delay
    assert np.isclose(_lower_bound(env, 0, 2), 25.5)
