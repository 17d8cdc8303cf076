"""``ssdsl show``: figures equal the analytic ones; a wrong plan exits 2 at its order line."""

from __future__ import annotations

import json

from ssdsl.cli import main

BAD = """plan bad()
microbatch along batch into 2
stages into 2 as st
assign st[0] to device 0
assign st[1] to device 1
order on device 0: forward st[0] mb 0, backward st[0] mb 0, forward st[0] mb 1, backward st[0] mb 1
order on device 1: forward st[1] mb 1, backward st[1] mb 1, forward st[1] mb 0, backward st[1] mb 0
"""


def test_show_prints_timeline_and_writes_svg(tmp_path, capsys):
    out = tmp_path / "p.svg"
    assert main(["show", "1f1b", "--world", "4", "--set", "microbatches=8", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dev 3" in text and "idle/busy 37.5%" in text and "4 3 2 1" in text
    assert out.read_text().startswith("<svg")


def test_show_json_interleaved(capsys):
    assert main(["show", "interleaved_1f1b", "--world", "4", "--set", "microbatches=8",
                 "--json", "--no-picture"]) == 0
    fig = json.loads(capsys.readouterr().out)
    assert abs(fig["bubble_overhead"] - 3 / 16) < 1e-12
    assert len(fig["programs"]) == 4


def test_show_wrong_plan_exits_2_at_its_line(tmp_path, capsys):
    plan = tmp_path / "bad.ssp"
    plan.write_text(BAD)
    assert main(["show", str(plan), "--world", "2", "--no-picture"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].endswith("bad.ssp:6:1: deadlock (async sends): devices 0, 1 wait "
                                        "for each other in a cycle")
    assert "[1F1]" in err


def test_show_plan_without_stages(capsys):
    assert main(["show", "dp", "--world", "2", "--no-picture"]) == 2
    assert "no 'stages'" in capsys.readouterr().err


def test_show_with_a_model_takes_its_stages_from_the_trace(capsys):
    """``show MODEL PLAN``: the forward-only stages of a recycling model come from its trace
    (without them every stage of recycle_1f1b lacked its backwards); the figures equal those of
    the 3F1B schedule built by hand (``schedule.builders.three_f_one_b``)."""
    from pathlib import Path

    from ssdsl.schedule.builders import three_f_one_b
    from ssdsl.schedule.simulate import simulate
    model = Path(__file__).resolve().parent.parent / "examples" / "evoformer_recycle.py"
    assert main(["show", str(model), "recycle_1f1b", "--world", "4", "--set",
                 "microbatches=8", "--json", "--no-picture"]) == 0
    fig = json.loads(capsys.readouterr().out)
    want = simulate(three_f_one_b(4, 8, 3))
    assert fig["makespan"] == want.makespan
    assert fig["bubble_ratio"] == want.bubble_ratio
    assert fig["peak_activations"] == list(want.peak_activations)
