"""The corpus of plans that are wrong for a given model: tests/plans/transform_bad/*.ssp.

Each file starts with a header written by hand from the plan text and the model::

    # model: gpt            (examples/gpt.py; a name ending in .py is a file beside the plan)
    # world: 2
    # expect: ErrorClass LINE:COL
    # message: a substring the message must contain

The plan is elaborated, transformed and scheduled against the model traced on the meta device; the first
error must be of that class, at that position of the plan file, and say that.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ssdsl.elaborate import elaborate_file
from ssdsl.errors import ErrorGroup, SsdslError
from ssdsl.ir.graph import Graph
from ssdsl.runtime.job import schedule_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform
from ssdsl.transform.apply import apply_directives
from ssdsl.transform.errors import BadDevice

BAD = Path(__file__).parent / "plans" / "transform_bad"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FILES = sorted(BAD.glob("*.ssp"))
HEADER = re.compile(r"# (model|world|expect|message): (.*)")
_GRAPHS: dict[Path, Graph] = {}


def header(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = HEADER.match(line)
        if not m:
            break
        out[m.group(1)] = m.group(2).strip()
    assert set(out) == {"model", "world", "expect", "message"}, f"{path.name}: incomplete header"
    return out


def model_path(name: str) -> Path:
    return BAD / name if name.endswith(".py") else EXAMPLES / f"{name}.py"


def graph_of(path: Path) -> Graph:
    if path not in _GRAPHS:
        _GRAPHS[path] = trace(load_model_file(path))
    return _GRAPHS[path]


def first_error(path: Path, head: dict[str, str]) -> SsdslError:
    graph = graph_of(model_path(head["model"]))
    with pytest.raises(SsdslError) as info:
        # transform, then the schedule phase (orders, recompute, stages): what `check` runs
        schedule_plan(graph, elaborate_file(path, world=int(head["world"])))
    err = info.value
    return err.errors[0] if isinstance(err, ErrorGroup) else err


def test_corpus_size_and_variety() -> None:
    classes = {header(p)["expect"].split()[0] for p in FILES}
    assert len(FILES) >= 8
    assert {"EmptySelection", "MissingDim", "IndivisibleError", "FrozenDimError",
            "NotAnnotatedError", "PartCountMismatch", "UnplacedPart"} <= classes


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_bad_plan(path: Path) -> None:
    head = header(path)
    cls, pos = head["expect"].split()
    line, column = map(int, pos.split(":"))
    err = first_error(path, head)
    rendered = err.render()
    assert type(err).__name__ == cls, rendered
    assert err.span is not None, rendered
    assert Path(err.span.file).name == path.name, rendered
    assert (err.span.line, err.span.column) == (line, column), rendered
    assert head["message"] in err.message, rendered
    assert rendered.startswith(f"{err.span.file}:{line}:{column}: "), rendered
    assert "^" in rendered


def test_bad_device_when_world_is_smaller_than_the_plan() -> None:
    """The elaborator checks devices against its world; the transform checks its own world too
    (a plan elaborated for 4 devices, applied to a run of 2)."""
    graph = graph_of(EXAMPLES / "mlp.py")
    plan = elaborate_file("dp", world=4)
    with pytest.raises(SsdslError) as info:
        apply_directives(graph, plan.directives, world=2)
    errors = info.value.errors if isinstance(info.value, ErrorGroup) else [info.value]
    assert {type(e) for e in errors} == {BadDevice}
    assert len(errors) == 2   # devices 2 and 3
    assert all(e.span.file.endswith("dp.ssp") for e in errors)
    assert "device 2 is outside the 2 devices" in errors[0].message


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_check_prints_it_briefly(path: Path, capsys) -> None:
    """`ssdsl check MODEL PLAN`: exit status 2, the position, a hint, no traceback, under 40
    lines."""
    from ssdsl.cli import main
    head = header(path)
    line, column = map(int, head["expect"].split()[1].split(":"))
    assert main(["check", str(model_path(head["model"])), str(path), "--world",
                 head["world"]]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    assert len(text.splitlines()) < 40, text
    assert f"{path.name}:{line}:{column}: " in text, text
    assert "\nhint: " in text, text


def test_a_misspelt_dim_gets_the_nearest_name(tmp_path) -> None:
    """The hint names the dim the selected operators have that the plan most likely meant, and
    none when nothing is near (oracle: the dims `ssdsl trace` lists for a linear: batch, seq,
    in, out)."""
    graph = graph_of(EXAMPLES / "gpt.py")

    def hint_for(dim: str) -> str:
        path = tmp_path / f"misspelt_{dim}.ssp"
        path.write_text(f"plan misspelt(tp: int = world)\n"
                        f"partition h.*.mlp.c_fc along {dim} into tp\n"
                        f"replicate rest into tp\nassign each part i to device i\n")
        with pytest.raises(SsdslError) as info:
            schedule_plan(graph, elaborate_file(path, world=2))
        err = info.value.errors[0] if isinstance(info.value, ErrorGroup) else info.value
        assert type(err).__name__ == "MissingDim" and (err.span.line, err.span.column) == (2, 1)
        return err.hint

    assert hint_for("outt").startswith("did you mean 'out'?")
    assert hint_for("sequ").startswith("did you mean 'seq'?")
    assert "did you mean" not in hint_for("hiden")


def test_an_assign_of_parts_a_failed_split_would_have_made_adds_no_error(tmp_path) -> None:
    """`partition all along time` fails (no operator has that dim); the `assign each part i`
    after it names parts that split would have made, and reports nothing of its own (it used to
    add one error per part, each repeating the first). An assign's own fault still shows."""
    path = BAD / "dim_missing_then_parts.ssp"
    graph = graph_of(EXAMPLES / "gpt.py")
    with pytest.raises(SsdslError) as info:
        schedule_plan(graph, elaborate_file(path, world=2))
    assert not isinstance(info.value, ErrorGroup), info.value.render()
    assert type(info.value).__name__ == "MissingDim"
    shifted = tmp_path / "shifted.ssp"
    shifted.write_text(path.read_text().replace("assign each part i to device i",
                                                "assign each part i to device i + 1"))
    with pytest.raises(SsdslError) as info:
        schedule_plan(graph, elaborate_file(shifted, world=2))
    errors = info.value.errors if isinstance(info.value, ErrorGroup) else [info.value]
    assert any("device 2" in e.message for e in errors), [e.message for e in errors]


def test_a_statement_failing_alike_in_every_turn_of_a_loop_is_one_error(tmp_path):
    """An assign in a ``for`` loop that fails the same way each turn: one error, not one per
    turn (the same line, message and hint)."""
    from ssdsl.cli import main
    plan = tmp_path / "loop.ssp"
    plan.write_text("plan p()\npartition all along batch into 2\nfor i in 0..2:\n"
                    "    assign part i of all to devices [0, 1, 2]\n")
    with pytest.raises(SsdslError) as info:
        transform(graph_of(EXAMPLES / "mlp.py"), elaborate_file(plan, world=4))
    assert not isinstance(info.value, ErrorGroup), info.value
    assert type(info.value).__name__ == "PartCountMismatch" and info.value.span.line == 4
    assert "has 1 part," in info.value.message
    assert main(["check", str(EXAMPLES / "mlp.py"), str(plan), "--world", "4"]) == 2
