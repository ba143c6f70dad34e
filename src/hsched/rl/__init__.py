"""Agent building blocks (DESIGN.md §3): replay buffers, exploration schedules, target updates.

NumPy only; the PyTorch agents (one readable module per algorithm) build on these.
"""

from hsched.rl.buffers import Batch, DualReplayBuffer, PrioritizedReplayBuffer, ReplayBuffer, SumTree
from hsched.rl.schedules import ExponentialSchedule, LinearSchedule, epsilon_greedy, hard_update, soft_update

__all__ = [
    "Batch",
    "DualReplayBuffer",
    "ExponentialSchedule",
    "LinearSchedule",
    "PrioritizedReplayBuffer",
    "ReplayBuffer",
    "SumTree",
    "epsilon_greedy",
    "hard_update",
    "soft_update",
]
