"""Gymnasium environments for the three learning problems (DESIGN §3), built on the library's domain,
cost and thermal code. Importing this package registers them (entry points load lazily):

    hsched/Path-v0         paper 003 §2.1: next-hop choice on a WAN graph, reward eq.11
    hsched/DcPlacement-v0  paper 003 §2.2: server choice in a thermal room, reward eq.12
    hsched/GpuCluster-v0   paper 000 §3: host (or wait) choice across GPU clusters, reward eq.15-17
    hsched/DagScheduling-v0  paper 004: (stage, executor count) choice for Spark DAG jobs, reward −Δt·J
    hsched/Colocation-v0   paper 001: offline DAG stages onto container slices beside preempting online tasks
"""

from __future__ import annotations

import gymnasium

_ENVS = {
    "hsched/Path-v0": "hsched.envs.path:PathEnv",
    "hsched/DcPlacement-v0": "hsched.envs.dc:DcPlacementEnv",
    "hsched/GpuCluster-v0": "hsched.envs.gpu:GpuClusterEnv",
    "hsched/DagScheduling-v0": "hsched.envs.dag:DagSchedulingEnv",
    "hsched/Colocation-v0": "hsched.envs.colocation:ColocationEnv",
}

# Gymnasium expects step() to take any action of the space (check_env samples them): the masked envs, made
# through gymnasium.make, map an action outside their masks to the nearest allowed one (flagged in info)
_KWARGS = {"hsched/DagScheduling-v0": {"invalid_action": "nearest"},
           "hsched/Colocation-v0": {"invalid_action": "nearest"}}

for _id, _entry in _ENVS.items():
    if _id not in gymnasium.registry:
        gymnasium.register(id=_id, entry_point=_entry, kwargs=_KWARGS.get(_id, {}))
