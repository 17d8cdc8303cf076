"""A forward torch.export cannot trace (a loop over the experts a batch hits, in Mixtral's eager
MoE block) is refused in a few lines, at the line the trace stopped at, with exit status 2:
torch.export's dump of the partial graph (hundreds of lines on stderr) is held back. The oracle
is the model's own source: the named line holds the loop."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ssdsl.cli import main

MODEL = Path(__file__).resolve().parent / "models" / "families" / "hf_mixtral_eager.py"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
def test_a_loop_over_data_is_refused_at_its_line_in_a_few_lines(capsys):
    assert main(["check", str(MODEL), "dp", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) < 10, err
    assert "Traceback" not in err and "the trace stopped at this line" in err
    located = err.split(":", 3)  # PATH:LINE:COL: message
    path, line = located[0], int(located[1])
    import transformers
    full = Path(transformers.__file__).parent.parent / path
    source = (full if full.exists() else Path(path)).read_text().splitlines()[line - 1]
    assert source.lstrip().startswith("for ") and "expert" in source, source
