"""Balanced stages against a brute force over every way to cut."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ssdsl.schedule.stages import balance_stages

ROOT = Path(__file__).resolve().parent.parent


def _brute_best(costs, n):
    k = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, k), n - 1):
        b = (0,) + cuts + (k,)
        worst = max(sum(costs[b[i]:b[i + 1]]) for i in range(n))
        best = worst if best is None else min(best, worst)
    return best


@given(st.lists(st.integers(1, 20), min_size=1, max_size=9), st.integers(1, 9))
def test_balance_matches_brute_force(costs, n):
    n = min(n, len(costs))
    parts = balance_stages(costs, n)
    assert len(parts) == n and all(len(r) > 0 for r in parts)
    assert [i for r in parts for i in r] == list(range(len(costs)))
    assert max(sum(costs[i] for i in r) for r in parts) == _brute_best(costs, n)


def test_balance_rejects_too_many_stages():
    with pytest.raises(ValueError):
        balance_stages([1, 2], 3)


def _brute_least_crossing(costs, n, crossing, slack):
    """Every cut: the least total crossing within (1 + slack) of the best balance, then the
    smallest largest segment among those."""
    k = len(costs)
    cuts_all = list(itertools.combinations(range(1, k), n - 1))
    worst = {c: max(sum(costs[b[i]:b[i + 1]]) for b in [(0, *c, k)] for i in range(n))
             for c in cuts_all}
    limit = min(worst.values()) * (1 + slack)
    ok = [c for c in cuts_all if worst[c] <= limit + 1e-9]
    least = min(sum(crossing[i] for i in c) for c in ok)
    return least, min(worst[c] for c in ok if sum(crossing[i] for i in c) == least)


@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=9),
       st.integers(1, 9), st.sampled_from([0.1, 0.25, 1.0]))
def test_least_crossing_within_the_slack_matches_brute_force(items, n, slack):
    """The least crossing within the slack (the rule for a heavy segment off: it trades
    crossing for balance among the others, tested below)."""
    from ssdsl.schedule import stages

    costs = [c for c, _ in items]
    crossing = [x for _, x in items]
    n = min(n, len(costs))
    heavy, stages.HEAVY = stages.HEAVY, float("inf")
    try:
        parts = balance_stages(costs, n, crossing=crossing, slack=slack)
    finally:
        stages.HEAVY = heavy
    assert len(parts) == n and all(len(r) > 0 for r in parts)
    assert [i for r in parts for i in r] == list(range(len(costs)))
    if n == 1:
        return
    least, worst = _brute_least_crossing(costs, n, crossing, slack)
    assert sum(crossing[r.start] for r in parts[1:]) == least
    assert max(sum(costs[i] for i in r) for r in parts) == worst


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 30)), min_size=1, max_size=9),
       st.integers(1, 9), st.sampled_from([0.0, 0.1, 0.25]))
def test_a_heavy_segment_keeps_the_balance_within_the_slack(items, n, slack):
    """With the rule for a heavy segment on (the others balanced among themselves), the cut is
    still n contiguous non-empty segments whose largest is within the slack of the brute
    force's best balance (exactly the best without crossing)."""
    costs = [c for c, _ in items]
    crossing = [x for _, x in items]
    n = min(n, len(costs))
    parts = (balance_stages(costs, n, crossing=crossing, slack=slack) if slack else
             balance_stages(costs, n))
    assert len(parts) == n and all(len(r) > 0 for r in parts)
    assert [i for r in parts for i in r] == list(range(len(costs)))
    assert max(sum(costs[i] for i in r) for r in parts) <= _brute_best(costs, n) * (1 + slack)


def test_an_lm_head_heavier_than_blocks_leaves_the_blocks_spread_evenly():
    """Positions and embeddings (cost ~0), 12 equal blocks, an LM head of 4.5 blocks and the
    loss (~0), into 8 stages: the head bounds every cut, and the least crossing (every cut
    between blocks sends the same) once gave three stages of four blocks beside near-empty
    ones. The oracle, by hand: the head with the loss, and the 12 blocks over the other 7
    stages, at most 2 blocks each (the fewest the 7 can hold them in)."""
    costs = [0.0, 0.0, 0.0] + [1.0] * 12 + [4.5, 0.0]
    crossing = [0.0, 1.0, 1.0] + [1.0] * 12 + [1.0, 50.0]
    parts = balance_stages(costs, 8, crossing=crossing, slack=0.05)
    sums = [sum(costs[i] for i in r) for r in parts]
    assert parts[-1] == range(15, 17)
    assert max(sums[:-1]) == 2.0, sums


def test_a_convolutions_cost_is_its_multiply_adds(tmp_path):
    """``op_cost`` of a convolution: batch x output channels x output positions x input
    channels x kernel (oracle: the shapes, by hand), not times the input positions as well
    (which made a ResNet's stem outweigh the whole rest and put every layer on one stage)."""
    from ssdsl.elaborate import elaborate_file
    from ssdsl.schedule.resolve import op_cost
    from ssdsl.trace.export import trace
    from ssdsl.trace.model_file import load_model_file
    from ssdsl.transform import transform

    (tmp_path / "conv.py").write_text(
        "import torch\nimport torch.nn as nn\nBATCH_SIZE = 2\n"
        "INPUT_DIMS = (('batch', 'c', 'h', 'w'),)\n"
        "def build_model():\n"
        "    return nn.Sequential(nn.Conv2d(3, 8, 5, stride=2, padding=2), nn.Flatten(),"
        " nn.Linear(8 * 16 * 16, 4))\n"
        "def get_batch(step, batch_size):\n"
        "    g = torch.Generator().manual_seed(step)\n"
        "    return ((torch.randn(batch_size, 3, 32, 32, generator=g),),"
        " torch.randint(0, 4, (batch_size,), generator=g))\n")
    (tmp_path / "p.ssp").write_text("plan p()\nassign all to device 0\n")
    graph = trace(load_model_file(str(tmp_path / "conv.py")), device="meta")
    t = transform(graph, elaborate_file(str(tmp_path / "p.ssp"), world=1))
    (conv,) = [op for op in graph.ops if op.kind == "conv2d"]
    assert op_cost(t, conv) == 2 * 8 * 16 * 16 * 3 * 5 * 5


def _costs_of(tmp_path, name: str, model_text: str) -> tuple:
    from ssdsl.elaborate import elaborate_file
    from ssdsl.schedule.resolve import op_cost
    from ssdsl.trace.export import trace
    from ssdsl.trace.model_file import load_model_file
    from ssdsl.transform import transform

    (tmp_path / f"{name}.py").write_text(model_text)
    (tmp_path / "p.ssp").write_text("plan p()\nassign all to device 0\n")
    graph = trace(load_model_file(str(tmp_path / f"{name}.py")), device="meta")
    t = transform(graph, elaborate_file(str(tmp_path / "p.ssp"), world=1))
    return graph, (lambda op: op_cost(t, op))


def test_a_pool_and_an_embedding_cost_their_outputs_not_their_inputs_too(tmp_path):
    """Each output element of a max-pool reads a window of input positions and each row of an
    embedding one row of its table: ``op_cost`` is the output's size (oracle: the shapes, by
    hand). Before, the pool weighed as input positions times output positions and the lookup
    as tokens times width times vocabulary (an LM's token embedding as much as its head)."""
    graph, cost = _costs_of(tmp_path, "pools", (
        "import torch\nimport torch.nn as nn\nBATCH_SIZE = 2\n"
        "INPUT_DIMS = (('batch', 'c', 'h', 'w'),)\n"
        "def build_model():\n"
        "    return nn.Sequential(nn.MaxPool2d(3, stride=2, padding=1),"
        " nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))\n"
        "def get_batch(step, batch_size):\n"
        "    g = torch.Generator().manual_seed(step)\n"
        "    return ((torch.randn(batch_size, 3, 32, 32, generator=g),),"
        " torch.randint(0, 4, (batch_size,), generator=g))\n"))
    (pool,) = [op for op in graph.ops if op.kind.startswith("max_pool2d")]
    (adaptive,) = [op for op in graph.ops if "adaptive_avg_pool2d" in op.kind]
    assert cost(pool) == 2 * 3 * 16 * 16
    assert cost(adaptive) == 2 * 3 * 4 * 4
    graph, cost = _costs_of(tmp_path, "lookup", (
        "import torch\nimport torch.nn as nn\nBATCH_SIZE = 2\n"
        "def build_model():\n"
        "    return nn.Sequential(nn.Embedding(1000, 8), nn.Flatten(), nn.Linear(5 * 8, 4))\n"
        "def get_batch(step, batch_size):\n"
        "    g = torch.Generator().manual_seed(step)\n"
        "    return ((torch.randint(0, 1000, (batch_size, 5), generator=g),),"
        " torch.randint(0, 4, (batch_size,), generator=g))\n"))
    (emb,) = [op for op in graph.ops if op.kind == "embedding"]
    assert cost(emb) == 2 * 5 * 8


def test_an_attention_and_the_views_around_it_cost_what_they_touch(tmp_path):
    """A fused q/k/v projection split three ways, heads made by views, attention, and a
    concatenation: the attention costs its two products, batch x heads x queries x keys x
    (head dim + value dim) multiply-adds; the split, the views and the concatenation cost their
    largest tensor's elements (oracle: the shapes, by hand). Before, a split or a concatenation
    weighed as the product of the labels on both its sides, and the attention counted the head
    dim twice over."""
    graph, cost = _costs_of(tmp_path, "attn", (
        "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\nBATCH_SIZE = 2\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.qkv = nn.Linear(16, 48)\n"
        "        self.out = nn.Linear(32, 4)\n"
        "    def forward(self, x):\n"
        "        q, k, v = self.qkv(x).split(16, dim=-1)\n"
        "        q, k, v = (t.view(2, 10, 4, 4).transpose(1, 2) for t in (q, k, v))\n"
        "        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 10, 16)\n"
        "        return self.out(torch.cat([y, x], dim=-1)).mean(1)\n"
        "def build_model():\n"
        "    return Net()\n"
        "def get_batch(step, batch_size):\n"
        "    g = torch.Generator().manual_seed(step)\n"
        "    return ((torch.randn(batch_size, 10, 16, generator=g),),"
        " torch.randint(0, 4, (batch_size,), generator=g))\n"))
    kinds = {op.kind: op for op in graph.ops}
    assert cost(kinds["sdpa"]) == 2 * 4 * 10 * 10 * (4 + 4)
    assert cost(kinds["split"]) == 2 * 10 * 48
    assert cost(kinds["cat"]) == 2 * 10 * 32
    assert cost(kinds["linear"]) in (2 * 10 * 16 * 48, 2 * 10 * 32 * 4)


@pytest.mark.parametrize("model", ["gpt", "hf_gpt2"])
def test_every_automatic_stage_has_a_backward(model):
    """``stages into N`` on GPTs whose leading operators (positions, the tied weight's alias)
    need no batch and no gradient: no stage is made of those alone, whatever N (a stage that
    runs forwards only refuses a 1F1B order; the least-crossing cut favoured it once costs no
    longer overweighed the embedding). Oracle: the stage graph's own forward-only set, and the
    schedule check passing."""
    from ssdsl.elaborate import elaborate_file
    from ssdsl.runtime.job import schedule_plan
    from ssdsl.trace.export import trace
    from ssdsl.trace.model_file import load_model_file

    if model == "hf_gpt2":
        pytest.importorskip("transformers")
    graph = trace(load_model_file(str(ROOT / "examples" / f"{model}.py")), device="meta")
    for plan, world, sets in [*(("1f1b", n, {}) for n in (2, 3, 4, 6, 8)),
                              *(("interleaved_1f1b", n, {"chunks": "2"}) for n in (2, 4))]:
        t, lowered = schedule_plan(graph, elaborate_file(plan, world=world,
                                                         sets={"microbatches": "4", **sets}))
        stages = lowered.schedule.stages
        assert not stages.forward_only, (plan, world, stages.forward_only)
        assert len(set(t.stage_of.values())) == stages.num_stages


def test_a_costly_prelude_without_gradient_is_no_stage_of_its_own(tmp_path):
    """A model that first computes, from the batch alone, a mask as costly as what follows
    (nothing of it needs a gradient): the balanced cut would make the mask stage 0, which runs
    forwards only and which 1F1B's order refuses. The cut keeps it with the first operator that
    has a backward (oracle: the stage graph's forward-only set; the schedule check passing)."""
    from ssdsl.elaborate import elaborate_file
    from ssdsl.runtime.job import schedule_plan
    from ssdsl.trace.export import trace
    from ssdsl.trace.model_file import load_model_file

    (tmp_path / "prelude.py").write_text(
        "import torch\nimport torch.nn as nn\nBATCH_SIZE = 4\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = nn.Linear(4096, 8)\n"
        "        self.b = nn.Linear(8, 4)\n"
        "    def forward(self, x):\n"
        "        m = (x > 0).float().cumsum(-1)\n"
        "        m = m / m.amax(-1, keepdim=True)\n"
        "        return self.b(torch.tanh(self.a(x * m)))\n"
        "def build_model():\n"
        "    return Net()\n"
        "def get_batch(step, batch_size):\n"
        "    g = torch.Generator().manual_seed(step)\n"
        "    return ((torch.randn(batch_size, 4096, generator=g),),"
        " torch.randint(0, 4, (batch_size,), generator=g))\n")
    graph = trace(load_model_file(str(tmp_path / "prelude.py")), device="meta")
    t, lowered = schedule_plan(graph, elaborate_file("1f1b", world=2, sets={"microbatches": "2"}))
    assert not lowered.schedule.stages.forward_only
    (a,) = [op for op in graph.ops if op.kind == "linear" and op.module == "a"]
    assert t.stage_of[a.name] == 0
