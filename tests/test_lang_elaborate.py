"""Elaboration: the directives of the stdlib plans and of small plans, against references
written here in plain Python (schedules, device numbering), not by the elaborator."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssdsl.elaborate import directives as D
from ssdsl.elaborate import elaborate_file, elaborate_text
from ssdsl.elaborate import errors as E
from ssdsl.errors import ErrorGroup, SsdslError

H = "plan p(n: int = 2)\n"


def _sequences(plan) -> dict[int, list[tuple[str, int, int]]]:
    """device -> [(pass letter, stage index, mb)], concatenated in plan order."""
    out: dict[int, list] = {}
    for d in plan.directives:
        if isinstance(d, D.OrderSequence):
            for dev in d.devices:
                out.setdefault(dev, []).extend(
                    (u.pass_[0].upper(), u.selector.index, u.mb) for u in d.units)
    return out


def _one_f_one_b_reference(stages: int, mbs: int, s: int) -> list[tuple[str, int, int]]:
    """1F1B on stage s, from the PipeDream-Flush description: warm-up forwards, then
    alternate one forward and one backward, then the remaining backwards."""
    warm = min(stages - s - 1, mbs)
    seq = [("F", s, m) for m in range(warm)]
    f, b = warm, 0
    while f < mbs:
        seq += [("F", s, f), ("B", s, b)]
        f, b = f + 1, b + 1
    seq += [("B", s, m) for m in range(b, mbs)]
    return seq


@pytest.mark.parametrize("stages,mbs", [(1, 1), (2, 4), (4, 8), (4, 2), (3, 7)])
def test_1f1b_matches_the_reference_schedule(stages, mbs):
    plan = elaborate_file("1f1b", world=stages, sets={"microbatches": str(mbs)})
    seqs = _sequences(plan)
    assert sorted(seqs) == list(range(stages))
    for s in range(stages):
        assert seqs[s] == _one_f_one_b_reference(stages, mbs, s)
    assigns = [(d.selector, d.devices) for d in plan.directives if isinstance(d, D.Assign)]
    assert assigns == [(D.StageRef("st", s), (s,)) for s in range(stages)]


@pytest.mark.parametrize("stages,mbs", [(2, 3), (3, 5)])
def test_gpipe_runs_all_forwards_then_all_backwards(stages, mbs):
    plan = elaborate_file("gpipe", world=stages, sets={"microbatches": str(mbs)})
    for s, seq in _sequences(plan).items():
        assert seq == [("F", s, m) for m in range(mbs)] + [("B", s, m) for m in range(mbs)]


@pytest.mark.parametrize("stages,chunks,mbs", [(2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 3, 4)])
def test_interleaved_1f1b_is_a_complete_megatron_schedule(stages, chunks, mbs):
    plan = elaborate_file("interleaved_1f1b", world=stages,
                          sets={"chunks": str(chunks), "microbatches": str(mbs)})
    seqs = _sequences(plan)
    for d in range(stages):
        seq = seqs[d]
        mine = {c * stages + d for c in range(chunks)}
        expected = {(p, v, m) for p in "FB" for v in mine for m in range(mbs)}
        assert sorted(seq) == sorted(expected)  # every unit once, only this device's stages
        pos = {u: i for i, u in enumerate(seq)}
        assert all(pos[("F", v, m)] < pos[("B", v, m)] for v in mine for m in range(mbs))
        # Megatron-LM's warm-up length (schedules.py, interleaved): forwards before the first B
        warm = min((stages - d - 1) * 2 + (chunks - 1) * stages, mbs * chunks)
        first_b = next(i for i, u in enumerate(seq) if u[0] == "B")
        assert first_b == warm + (1 if warm < mbs * chunks else 0)
        # the first backward of the last device is its last chunk's first micro-batch
        if d == stages - 1 and warm < mbs * chunks:
            assert seq[first_b] == ("B", (chunks - 1) * stages + d, 0)


def test_dp_assigns_part_i_to_device_i():
    plan = elaborate_file("dp", world=3)
    assert [str(d) for d in plan.directives] == [
        "partition all along batch into 3", "assign part 0 of all to device 0",
        "assign part 1 of all to device 1", "assign part 2 of all to device 2"]


def test_dp_tp_device_numbering_is_row_major():
    dp, tp = 2, 3
    plan = elaborate_file("dp_tp", world=6, sets={"dp": str(dp)})
    got = {d.selector.index: d.devices for d in plan.directives if isinstance(d, D.Assign)}
    assert got == {(i, j): (i * tp + j,) for i in range(dp) for j in range(tp)}
    # the megatron directives came through `use`: their positions are in megatron_tp.ssp
    parts = [d for d in plan.directives if isinstance(d, D.Partition)]
    assert Path(parts[0].span.file).name == "dp_tp.ssp"
    assert {Path(p.span.file).name for p in parts[1:]} == {"megatron_tp.ssp"}
    rest = next(d for d in plan.directives if isinstance(d, D.Replicate))
    # rest excludes only the partitions of megatron_tp itself, not dp_tp's batch split
    assert rest.selector == D.Rest(tuple(p.selector for p in parts[1:]))


def test_dp_tp_1f1b_stage_groups_are_contiguous_blocks():
    plan = elaborate_file("dp_tp_1f1b", world=8, sets={"dp": "2", "tp": "2"})
    spreads = {d.selector.index: d.devices for d in plan.directives
               if isinstance(d, D.Assign) and isinstance(d.selector, D.StageRef)}
    assert spreads == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    mesh = next(d for d in plan.directives if isinstance(d, D.Mesh))
    assert mesh.axes == (("pp", 2), ("dp", 2), ("tp", 2)) and mesh.devices == tuple(range(8))


def test_mesh_places_are_row_major_with_free_axes():
    text = ("plan p()\nmesh m = grid(pp=2, dp=2, tp=2)\n"
            "zero over m[pp=1]\nzero over m[dp=1]\nzero over m[1, *, 0]\n"
            "assign all to m[tp=1, pp=0, dp=1]\nzero over mesh m\n")
    plan = elaborate_text(text, world=8)
    got = [d.devices for d in plan.directives[1:]]
    # device = pp * 4 + dp * 2 + tp
    assert got == [(4, 5, 6, 7), (2, 3, 6, 7), (4, 6), (3,), tuple(range(8))]


def test_mesh_from_offset_and_each_part_in_a_space():
    text = ("plan p()\nmesh m = grid(a=2, b=2) from 4\n"
            "assign each part (i, j) of h.0 in [0..2, [1, 0]] to m[b=j, a=i]\n")
    plan = elaborate_text(text, world=8)
    got = [(d.selector.index, d.devices) for d in plan.directives[1:]]
    assert got == [((0, 1), (5,)), ((0, 0), (4,)), ((1, 1), (7,)), ((1, 0), (6,))]


def test_selectors_stay_symbolic():
    text = (H + "stages into 2 as st\n"
            "recompute h.0..=3.attn | kind(linear, sdpa) & h.** except st[1]\n"
            "replicate part (1, 0) of (h.{n}.mlp | h.{\"1..3\"}.*) into 2\n"
            "replicate rest into 2\n")
    plan = elaborate_text(text, world=2)
    rec, rep, rest = plan.directives[1:]
    assert rec.selector == D.Except(
        D.Union(D.Path(("h", D.IndexRange(0, 4), "attn")),
                D.Intersect(D.Kind(("linear", "sdpa")), D.Path(("h", "**")))),
        D.StageRef("st", 1))
    assert str(rec) == "recompute h.0..4.attn | kind(linear, sdpa) & h.** except st[1]"
    assert rep.selector == D.PartOf((1, 0), D.Union(D.Path(("h", 2, "mlp")),
                                                    D.Path(("h", D.IndexRange(1, 3), "*"))))
    assert rest.selector == D.Rest((rep.selector,))


def test_order_units_and_interleave_of_unequal_lengths():
    text = ("plan p()\nmicrobatch along batch into 3\nstages into 1 as st\n"
            "order on device 0: interleave(forward st[0] mb 0..3, backward st[0] mb [2]), "
            "backward st[0] mb 0..2\n"
            "order h.0 before forward st[0] mb 2\n"
            "order on devices [0]: weight_grad st[0]\n")
    plan = elaborate_text(text, world=1)
    seq, before, wg = plan.directives[2:]
    assert [str(u) for u in seq.units] == [
        "forward st[0] mb 0", "backward st[0] mb 2", "forward st[0] mb 1", "forward st[0] mb 2",
        "backward st[0] mb 0", "backward st[0] mb 1"]
    assert (before.before.pass_, before.after.mb) == ("op", 2)
    assert [u.mb for u in wg.units] == [0, 1, 2]  # no mb: every micro-batch


def test_parameters_defaults_world_and_sets():
    text = ("plan p(a: int = world * 2, b: float = a / 4, c: bool = a > 3, s: str = \"x\", "
            "l: list = [a, 1])\n")
    assert elaborate_text(text, world=3).params == (
        ("a", 6), ("b", 1.5), ("c", True), ("s", "x"), ("l", (6, 1)))
    got = elaborate_text(text, sets={"world": "2", "b": "7", "c": "false", "s": "h.*",
                                     "l": "[1, 2]"}).params
    assert got == (("a", 4), ("b", 7.0), ("c", False), ("s", "h.*"), ("l", (1, 2)))
    with pytest.raises(E.BadSetValue) as info:
        elaborate_text(text, "p.ssp", sets={"a": "two"})
    assert (info.value.span.line, info.value.span.column) == (1, 8)
    with pytest.raises(E.MissingParameter):
        elaborate_text("plan p(k: int)\n")


@pytest.mark.parametrize("expr,value", [
    ("7 // 2", 3), ("-7 // 2", -4), ("-7 % 3", 2), ("7 / 2", 3.5), ("2 + 3 * 4", 14),
    ("(2 + 3) * 4", 20), ("min(3, 1, 2)", 1), ("max([4, 9])", 9), ("len(2..=5)", 4),
    ("sum(0..4)", 6), ("ceil_div(7, 2)", 4), ("abs(-3)", 3), ("int(\"12\")", 12),
    ("str(3) + \"x\"", "3x"), ("[1, 2] + [3]", (1, 2, 3)), ("(0..5)[2]", 2),
    ("not (1 < 2) or 2 >= 2 and true", True), ("1 == 1.0", True), ("\"a\" < \"b\"", True),
    ("list(1..3)", (1, 2)), ("float(1) / 4", 0.25)])
def test_expression_values(expr, value):
    plan = elaborate_text(f"plan p(v: {_type(value)} = {expr})\n")
    assert plan.params == (("v", value),)


def _type(value) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", tuple: "list"}[type(value)]


_ints = st.integers(min_value=-50, max_value=50)


@st.composite
def _arith(draw, depth=0):
    if depth > 3 or draw(st.booleans()):
        return str(draw(_ints))
    op = draw(st.sampled_from(["+", "-", "*", "//", "%"]))
    return f"({draw(_arith(depth + 1))} {op} {draw(_arith(depth + 1))})"


@settings(max_examples=150, deadline=None)
@given(_arith())
def test_integer_arithmetic_agrees_with_python(expr):
    try:
        expected = eval(expr)  # the oracle: Python's own integer semantics
    except ZeroDivisionError:
        with pytest.raises(E.DivisionByZero):
            elaborate_text(f"plan p(v: int = {expr})\n")
        return
    assert elaborate_text(f"plan p(v: int = {expr})\n").params == (("v", expected),)


def test_step_limit_stops_runaway_loops():
    text = "plan p()\nfor i in 0..1000000000:\n    replicate all into 1\n"
    with pytest.raises(E.TooManyDirectives):
        elaborate_text(text, max_steps=10_000)


def test_a_loop_too_long_for_the_bound_is_refused_at_its_header_before_it_runs():
    """Every loop step counts toward the bound, so a loop that cannot fit is refused at its
    header before its body runs once (a loop of millions ran to the bound first: 2 s for the
    default bound); the bound itself is exact: the steps and directives that fit are
    elaborated."""
    body = "\n    replicate all into 1\n"
    # 5 loop steps and 5 directives: 10 steps in all
    assert len(elaborate_text("plan p()\nfor i in 0..5:" + body, max_steps=10).directives) == 5
    with pytest.raises(E.TooManyDirectives) as err:
        elaborate_text("plan p()\nfor i in 0..6:" + body, max_steps=10)
    # a body that fails at its first step is never reached
    failing = '\n    require i > 0, "the body ran"\n'
    with pytest.raises(E.TooManyDirectives) as at_once:
        elaborate_text("plan p()\nfor i in 0..1000000000000000:" + failing, max_steps=10)
    # a range longer than 2**63 - 1 (Python's len() refuses it) is refused the same way
    with pytest.raises(E.TooManyDirectives) as widest:
        elaborate_text("plan p()\nfor i in (0 - 9223372036854775807)..9223372036854775807:"
                       + body, max_steps=10)
    for e in (err.value, at_once.value, widest.value):
        group = e.errors if isinstance(e, ErrorGroup) else [e]
        assert [(x.span.line, x.span.column) for x in group] == [(2, 5)]


def test_let_in_a_loop_body_is_scoped_to_the_iteration():
    text = ("plan p()\nlet x = 1\nfor i in 0..3:\n    let y = x + i\n    replicate h.{y} into 1\n")
    plan = elaborate_text(text)
    assert [d.selector.segments for d in plan.directives] == [("h", 1), ("h", 2), ("h", 3)]


def test_use_by_path_with_positional_args(tmp_path: Path):
    (tmp_path / "inner.ssp").write_text("plan inner(k: int, d: str = \"batch\")\n"
                                        "partition all along {d} into k\n".replace("{d}", "batch"))
    (tmp_path / "outer.ssp").write_text("plan outer(n: int = 2)\nuse \"inner.ssp\"(n * 2)\n"
                                        "use inner(1, \"x\")\n")
    plan = elaborate_file(tmp_path / "outer.ssp")
    assert [str(d) for d in plan.directives] == ["partition all along batch into 4",
                                                 "partition all along batch into 1"]
    assert all(Path(d.span.file).name == "inner.ssp" for d in plan.directives)


def test_errors_inside_a_used_plan_point_into_it(tmp_path: Path):
    (tmp_path / "inner.ssp").write_text("plan inner(k: int)\nreplicate all into 10 // k\n")
    (tmp_path / "outer.ssp").write_text("plan outer()\nuse inner(0)\n")
    with pytest.raises(E.DivisionByZero) as info:
        elaborate_file(tmp_path / "outer.ssp")
    assert Path(info.value.span.file).name == "inner.ssp"
    assert (info.value.span.line, info.value.span.column) == (2, 26)


def test_json_round_trips_through_the_json_module():
    import json
    plan = elaborate_file("dp_tp_1f1b", world=8, sets={"dp": "2", "tp": "2"})
    data = json.loads(json.dumps(plan.to_json()))
    assert data["params"]["pp"] == 2
    assert len(data["directives"]) == len(plan.directives)
    assert data["directives"][0]["kind"] == "mesh"
    assert data["directives"][-1]["span"]["file"].endswith("1f1b.ssp")


@pytest.mark.parametrize("name,world,sets", [
    ("dp", 1, {}), ("dp", 8, {}), ("megatron_tp", 4, {"placed": "false"}),
    ("1f1b", 8, {"microbatches": "16"}), ("gpipe", 4, {"width": "1"}),
    ("interleaved_1f1b", 4, {"chunks": "4"}), ("dp_tp", 8, {"dp": "4"}),
    ("dp_tp_1f1b", 16, {"dp": "2", "tp": "2", "microbatches": "8"}),
    ("one_f_one_b", 2, {})])
def test_stdlib_plans_elaborate(name, world, sets):
    plan = elaborate_file(name, world=world, sets=sets)
    assert plan.directives
    for d in plan.directives:
        assert str(d) and d.to_json()["kind"] == d.kind
        for dev in getattr(d, "devices", ()):
            assert 0 <= dev < world


def test_require_in_stdlib_is_reported_at_the_require_line():
    with pytest.raises(SsdslError) as info:
        elaborate_file("interleaved_1f1b", world=4, sets={"microbatches": "6"})
    err = info.value.errors[0] if isinstance(info.value, ErrorGroup) else info.value
    assert isinstance(err, E.RequirementFailed) and "multiple of stages" in err.message
