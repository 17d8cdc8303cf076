"""What the generated per-rank code says, checked against facts independent of the generator.

Oracles: Megatron-LM's communication pattern (one forward all-reduce after each row-parallel
linear, one backward all-reduce before each column-parallel one), data parallelism's batch split,
the model's own parameter shapes (shards must tile every parameter), the plan text (every cited
line exists and is a primitive), Python itself (literals and regions read back to the same value),
and, for world 1, the single-device reference training run.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ssdsl.codegen import Provenance, generate_all, generate_rank
from ssdsl.codegen.text import Namer, literal, parse_region, region_text
from ssdsl.elaborate import elaborate_file
from ssdsl.ir.region import Region
from ssdsl.materialize.program import materialize
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform

ROOT = Path(__file__).resolve().parent.parent
MLP, GPT = str(ROOT / "examples/mlp.py"), str(ROOT / "examples/gpt.py")
TP_SETS = (("attn_out", "attn.c_proj"), ("mlp_out", "mlp.c_proj"))


@cache
def _compiled(model: str, plan: str, world: int, sets: tuple = (), device: str = "meta"):
    mf = load_model_file(model)
    p = elaborate_file(plan, world=world, sets=dict(sets))
    m = materialize(transform(trace(mf, device=device), p))
    return m, generate_all(m, Provenance.of(model, p))


def _module(text: str) -> dict:
    ns: dict = {}
    exec(compile(text, "<generated>", "exec"), ns)
    return ns


def _forward_lines(text: str) -> list[str]:
    body = text.split("def train_step(rt, v):\n", 1)[1]
    return [line.strip() for line in body.splitlines() if line.startswith("    ")]


def _calls(text: str) -> dict[str, str]:
    """Output value -> its line, for the local ATen calls."""
    out = {}
    for line in _forward_lines(text):
        m = re.match(r"v\['([^']+)'\](?:, v\['[^']+'\])* = aten\.", line)
        if m:
            out[m.group(1)] = line
    return out


# -- Megatron: exactly the collectives of the paper --------------------------------------------


def test_megatron_forward_all_reduce_after_each_row_parallel_linear():
    m, texts = _compiled(GPT, "megatron_tp", 2, TP_SETS)
    graph = m.transformed.graph
    row = [op.outputs[0] for op in graph.ops
           if op.kind == "linear" and re.fullmatch(r"h\.\d+\.(attn|mlp)\.c_proj", op.module)]
    col = [op.name for op in graph.ops
           if op.kind == "linear" and re.fullmatch(r"h\.\d+\.(attn\.c_attn|mlp\.c_fc)", op.module)]
    assert len(row) == len(col) == 4  # 2 blocks x (attention, MLP)
    for text in texts.values():
        comms = [line for line in _forward_lines(text) if re.search(r" mb 0 (for|back)ward: ", line)]
        moving = [c for c in comms if "nothing moves" not in c]
        fwd_ar = [c for c in moving if re.search(r"forward: all_reduce over \(0, 1\)", c)]
        bwd_ar = [c for c in moving if re.search(r"backward: all_reduce over \(0, 1\)", c)]
        assert len(moving) == len(fwd_ar) + len(bwd_ar) == 8
        assert sorted(re.search(r"# (\w+) -> ", a).group(1) for a in fwd_ar) == sorted(row)
        fed = sorted(re.search(r"-> (\w+)\[0\]", a).group(1) for a in bwd_ar)
        assert fed == sorted(col)
        # the backward all-reduces run in the reverse order of their column-parallel linears
        assert [re.search(r"-> (\w+)\[0\]", a).group(1) for a in bwd_ar] == col[::-1]


def test_megatron_shards_tile_every_parameter():
    m, texts = _compiled(GPT, "megatron_tp", 2, TP_SETS)
    model = load_model_file(GPT).build(seed=0)
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters(remove_duplicate=False)}
    cover = {k: torch.zeros(s) for k, s in shapes.items()}
    for rank, text in texts.items():
        for graph_name, qual, region in _module(text)["SHARDS"]:
            r = parse_region(region, shapes[qual])
            Region.full(shapes[qual]).add_into(cover[qual], r, torch.ones(r.local_shape))
    held = {q for q, c in cover.items() if c.any()}
    tied = {a for q in held for a in graph_aliases(m, q)}
    assert held | tied == set(shapes)  # every parameter, under one of its tied names
    for qual, c in ((q, cover[q]) for q in held):
        # a split weight is held once per element, a replicated one by both ranks; the
        # row-parallel biases only by part 0 (the other part adds no bias to its partial sum)
        assert set(c.unique().tolist()) in ({1.0}, {2.0}), qual
    split = {q for q, c in cover.items() if c.max() == 1}
    assert {q for q in split if q.endswith("weight")} == {
        f"h.{i}.{w}.weight" for i in range(2) for w in ("attn.c_attn", "attn.c_proj",
                                                        "mlp.c_fc", "mlp.c_proj")}


def graph_aliases(m, qual: str) -> tuple[str, ...]:
    return tuple(m.transformed.graph.aliases.get(qual, ()))


# -- data parallelism ---------------------------------------------------------------------------


def test_dp_takes_its_batch_rows_and_whole_weights():
    m, texts = _compiled(MLP, "dp", 4)
    model = load_model_file(MLP).build(seed=0)
    batch = load_model_file(MLP).batch_size
    for rank in range(4):
        text = texts[f"rank{rank}.py"]
        assert "comm(" not in text  # the only communication is the gradient reducer
        assert text.count("reduce(") == 1 and "all_reduce 8 weight gradients over (0, 1, 2, 3)" \
            in text
        lo, hi = rank * batch // 4, (rank + 1) * batch // 4
        assert f"= batch[0] {lo}:{hi} x 0:32;" in text
        assert f"= batch[1] {lo}:{hi};" in text
        shards = {q: r for _, q, r in _module(text)["SHARDS"]}
        assert shards == {k: region_text(Region.full(tuple(v.shape)))
                          for k, v in model.named_parameters()}


# -- annotations -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mlp_dp", "gpt_tp"])
def test_every_statement_cites_plan_lines_that_exist(case):
    model, plan, sets = {"mlp_dp": (MLP, "dp", ()), "gpt_tp": (GPT, "megatron_tp", TP_SETS)}[case]
    _, texts = _compiled(model, plan, 2, sets)
    plan_lines = (ROOT / "stdlib_plans" / f"{plan}.ssp").read_text().splitlines()
    for text in texts.values():
        legend = dict(re.findall(rf"^#   ({plan}\.ssp:\d+:\d+)  (.*)$", text, re.M))
        assert legend
        for key, quoted in legend.items():
            line = int(key.split(":")[1])
            assert plan_lines[line - 1].strip() == quoted
            assert quoted.split()[0] in ("partition", "replicate", "assign")
        for stmt in _forward_lines(text):
            cites = re.findall(rf"{plan}\.ssp:\d+:\d+", stmt.split("  # ", 1)[1])
            assert all(c in legend for c in cites), stmt
            if "= aten." in stmt or "shard of" in stmt or "= batch[" in stmt:
                assert cites, stmt  # what a part computes or reads comes from the plan
        for line in _calls(text).values():  # a part: the statement that shaped it, its assign
            cited = re.findall(rf"{plan}\.ssp:\d+:\d+", line)
            assert [legend[c].split()[0] for c in cited][-1] == "assign", line


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_text_names_no_trace_device(device):
    # (the graphs themselves differ: a meta trace keeps a `contiguous` that a CPU trace drops)
    _, texts = _compiled(GPT, "megatron_tp", 2, TP_SETS, device)
    for text in texts.values():
        assert "device=rt.device" in text
        assert "meta" not in text.replace("megatron", "") and "device(type" not in text


def test_pipelined_plan_runs_its_units_in_the_schedules_order():
    """A 1F1B module walks its rank's units in the order of the schedule phase's program, each
    unit citing the plan's order statement."""
    from ssdsl.cli._resolve import _resolve
    mf = load_model_file(GPT)
    p = elaborate_file("1f1b", world=2, sets={"microbatches": "4"})
    t, lowered = _resolve(trace(mf, device="meta"), p)
    m = materialize(t, schedule=lowered)
    for rank in range(2):
        text = generate_rank(m, rank, Provenance.of(GPT, p))
        begun = re.findall(r"# unit (\d[FB]\d) begins; 1f1b\.ssp:\d+:\d+", text)
        assert begun == [str(u) for u in lowered.schedule.programs[rank].units]
        assert "rt(I" in text and text.count("optimizer step") == 1


# -- text forms --------------------------------------------------------------------------------


@st.composite
def regions(draw):
    shape = tuple(draw(st.lists(st.integers(1, 12), max_size=4)))
    ivs = []
    for size in shape:
        cuts = sorted(draw(st.sets(st.integers(0, size), max_size=6)))
        runs = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
        ivs.append(tuple(runs))
    v = draw(st.integers(1, 4))
    return Region(shape, tuple(ivs), (draw(st.integers(0, v - 1)), v))


@given(regions())
def test_region_text_reads_back(r):
    assert parse_region(region_text(r), r.shape) == r


@pytest.mark.parametrize("value", [
    (1, -2, None), [3], (4,), True, 0.1, 1e-5, float("inf"), float("-inf"), "tanh",
    torch.float64, torch.int64, torch.contiguous_format, torch.strided, [(0, 1), (2,)],
])
def test_literals_evaluate_to_the_value(value):
    assert eval(literal(value, str), {"torch": torch}) == value


def test_nan_and_device_literals():
    assert literal(float("nan"), str) == "float('nan')"
    assert literal(torch.device("meta"), str) == "rt.device"
    with pytest.raises(TypeError):
        literal(object(), str)


def test_namer_gives_distinct_identifiers():
    n = Namer()
    names = [n.fresh(x) for x in ("split.0", "split_0", "class", "rt", "1x", "a-b", "split.0")]
    assert all(x.isidentifier() for x in names)
    assert len(set(names)) == len(names)
    assert names[2] != "class" and names[3] != "rt"
