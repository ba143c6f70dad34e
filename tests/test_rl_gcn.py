"""hsched.rl.gcn: Decima-style DAG embeddings checked against a hand-computed diamond DAG."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hsched.rl.gcn import DagGCN, DagGraph, GraphBatch, node_levels

DIAMOND = DagGraph(features=np.array([[1.0], [2.0], [3.0], [4.0]]), edges=[(0, 1), (0, 2), (1, 3), (2, 3)])


def _set(mlp: torch.nn.Sequential, w1, b1, w2, b2) -> None:
    with torch.no_grad():
        mlp[0].weight.copy_(torch.tensor(w1, dtype=torch.float32))
        mlp[0].bias.copy_(torch.tensor(b1, dtype=torch.float32))
        mlp[2].weight.copy_(torch.tensor(w2, dtype=torch.float32))
        mlp[2].bias.copy_(torch.tensor(b2, dtype=torch.float32))


def _hand_weights() -> DagGCN:
    """1-wide GCN whose MLPs are affine on non-negative inputs: h(x)=x, f(e)=2e, g(m)=m+1, f_d(x,e)=x+e,
    g_d(s)=s, f_z(y)=3y, g_z(s)=s+5."""
    gcn = DagGCN(1, hidden=1, embed=1, seed=0)
    _set(gcn.prep, [[1.0]], [0.0], [[1.0]], [0.0])
    _set(gcn.message, [[1.0]], [0.0], [[2.0]], [0.0])
    _set(gcn.update, [[1.0]], [0.0], [[1.0]], [1.0])
    _set(gcn.dag_in, [[1.0, 1.0]], [0.0], [[1.0]], [0.0])
    _set(gcn.dag_out, [[1.0]], [0.0], [[1.0]], [0.0])
    _set(gcn.global_in, [[1.0]], [0.0], [[3.0]], [0.0])
    _set(gcn.global_out, [[1.0]], [0.0], [[1.0]], [5.0])
    return gcn


def test_levels_are_longest_path_to_a_leaf():
    assert node_levels(4, DIAMOND.edges).tolist() == [2, 1, 1, 0]
    assert node_levels(3, [(0, 2), (1, 2), (0, 1)]).tolist() == [2, 1, 0]
    with pytest.raises(ValueError, match="cycle"):
        node_levels(2, [(0, 1), (1, 0)])
    with pytest.raises(ValueError, match="outside"):
        node_levels(2, [(0, 2)])


def test_diamond_by_hand():
    # e3 = 4 (a leaf gets no update term); e1 = 2 + 2·4 + 1 = 11; e2 = 3 + 8 + 1 = 12; e0 = 1 + 2·(11+12) + 1 = 48
    # DAG: Σ (x + e) = 49 + 13 + 15 + 8 = 85; global: 3·85 + 5 = 260
    out = _hand_weights()(GraphBatch.build([[DIAMOND]]))
    assert out.node.squeeze(1).tolist() == [48.0, 11.0, 12.0, 4.0]
    assert out.dag.squeeze(1).tolist() == [85.0]
    assert out.global_.squeeze(1).tolist() == [260.0]


def test_batch_of_observations_by_hand():
    chain = DagGraph(features=np.array([[1.0], [1.0]]), edges=[(0, 1)])  # e1 = 1, e0 = 1 + 2 + 1 = 4; y = 2 + 5 = 7
    batch = GraphBatch.build([[DIAMOND, chain], [], [chain]])
    out = _hand_weights()(batch)
    assert out.node.squeeze(1).tolist() == [48.0, 11.0, 12.0, 4.0, 4.0, 1.0, 4.0, 1.0]
    assert out.dag.squeeze(1).tolist() == [85.0, 7.0, 7.0]
    assert out.global_.squeeze(1).tolist() == [3 * (85 + 7) + 5.0, 5.0, 3 * 7 + 5.0]
    assert batch.node_dag.tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert batch.dag_obs.tolist() == [0, 0, 2]
    assert batch.node_offsets.tolist() == [0, 4, 6, 8]


def test_batched_equals_one_by_one_and_seed_decides_weights():
    rng = np.random.default_rng(1)
    dags = [DagGraph(rng.normal(size=(4, 5)), DIAMOND.edges), DagGraph(rng.normal(size=(3, 5)), [(0, 2), (1, 2)]),
            DagGraph(rng.normal(size=(1, 5)), [])]
    gcn = DagGCN(5, seed=3)
    together = gcn(GraphBatch.build([dags[:2], dags[2:]]))
    alone = [gcn(GraphBatch.build([[d]])) for d in dags]
    torch.testing.assert_close(together.node, torch.cat([a.node for a in alone]))
    torch.testing.assert_close(together.dag, torch.cat([a.dag for a in alone]))
    torch.testing.assert_close(together.global_[1], gcn(GraphBatch.build([dags[2:]])).global_[0])
    again = DagGCN(5, seed=3)(GraphBatch.build([dags[:2], dags[2:]]))
    assert torch.equal(again.node, together.node) and torch.equal(again.global_, together.global_)
    other = DagGCN(5, seed=4)(GraphBatch.build([dags[:2], dags[2:]]))
    assert not torch.equal(other.node, together.node)


def test_gradients_reach_every_parameter():
    gcn = DagGCN(2, seed=0)
    out = gcn(GraphBatch.build([[DagGraph(np.ones((4, 2)), DIAMOND.edges)]]))
    (out.node.sum() + out.dag.sum() + out.global_.sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gcn.parameters())


def test_wrong_feature_width_is_named():
    with pytest.raises(ValueError, match="features"):
        GraphBatch.build([[DagGraph(np.ones((2, 3)), []), DagGraph(np.ones((2, 2)), [])]])
    with pytest.raises(ValueError, match="features"):
        DagGCN(2, seed=0)(GraphBatch.build([[DagGraph(np.ones((2, 3)), [])]]))
