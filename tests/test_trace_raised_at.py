"""A model whose forward raises under torch.export (not in eager or meta runs) is refused at the
line that raised (the innermost frame outside torch), not at the model file without a line.
Oracle: the line of the model file that holds the failing statement, found by text."""

from __future__ import annotations

from pathlib import Path

from ssdsl.cli import main

MODEL = Path(__file__).resolve().parent / "models" / "export_only_fault.py"


def test_an_export_fault_names_the_line_that_raised(capsys):
    line = next(i for i, text in enumerate(MODEL.read_text().splitlines(), 1)
                if "FAILS UNDER EXPORT" in text)
    code = main(["check", str(MODEL), "dp", "--world", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert f"export_only_fault.py:{line}:" in err, err
    assert "torch.export failed" in err
