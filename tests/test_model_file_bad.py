"""The corpus of wrong model files: each file in tests/models_bad names, in its first line, the
error class it must produce and where (``# expect: Class LINE:COL``; ``@`` for the line marked
``#<``, at its first non-blank character, ``@:COL`` at column COL of it; ``-`` for a fault with no line, such as a missing
function). The expectations were written by hand from the file text.

Every fault is found in the planning process (loading the file, then one forward and backward on
the meta device inside ``trace``), before any rank starts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ssdsl.cli import main
from ssdsl.errors import SsdslError
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file

BAD = Path(__file__).parent / "models_bad"
FILES = sorted(BAD.glob("*.py"))
EXPECT = re.compile(r"# expect: (\w+) (\d+:\d+|@(?::\d+)?|-)$")


def _expectation(path: Path) -> tuple[str, tuple[int, int] | None]:
    lines = path.read_text().splitlines()
    m = EXPECT.match(lines[0])
    assert m, f"{path.name}: first line must be '# expect: Class LINE:COL|@|-'"
    where = m.group(2)
    if where == "-":
        return m.group(1), None
    if where.startswith("@"):
        marked = [i for i, text in enumerate(lines, 1) if text.rstrip().endswith("#<")]
        assert len(marked) == 1, f"{path.name}: mark exactly one line with '#<'"
        text = lines[marked[0] - 1]
        column = int(where[2:]) if where[1:] else len(text) - len(text.lstrip()) + 1
        return m.group(1), (marked[0], column)
    line, column = where.split(":")
    return m.group(1), (int(line), int(column))


def _error(path: Path) -> SsdslError:
    with pytest.raises(SsdslError) as info:
        trace(load_model_file(path), device="meta")
    return info.value


def test_corpus_is_large_enough():
    assert len(FILES) >= 30


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_bad_model_file(path: Path):
    cls, where = _expectation(path)
    err = _error(path)
    assert type(err).__name__ == cls, err.render()
    assert Path(err.file).name == path.name, err.render()
    if where is None:
        assert err.span is None, err.render()
        assert "\nhint: " in err.render(), err.render()
        return
    assert err.span is not None, err.render()
    assert (err.span.line, err.span.column) == where, err.render()
    assert Path(err.span.file).name == path.name
    assert "^" in err.render()  # the model file's line with a caret under it
    assert "\nhint: " in err.render(), err.render()  # and what to do about it


@pytest.mark.parametrize("name", ["sys_exit_at_import", "forward_returns_tuple",
                                  "forward_shape_mismatch", "loss_reduction_none",
                                  "syntax_missing_colon"])
def test_check_reports_it_in_few_lines_with_status_two(name: str, capfd):
    path = BAD / f"{name}.py"
    assert main(["check", str(path), "dp", "--world", "1"]) == 2
    out = capfd.readouterr()  # file descriptors: torch's log handlers hold the real stderr
    text = out.out + out.err
    assert "Traceback" not in text
    assert len(text.splitlines()) < 40, text
    cls, where = _expectation(path)
    assert f"{path.name}:{where[0]}:{where[1]}: " in text


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_check_prints_every_one_briefly(path: Path, capfd):
    """The fast lane runs five files through `ssdsl check`; this runs them all."""
    assert main(["check", str(path), "dp", "--world", "1"]) == 2
    out = capfd.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    assert len(text.splitlines()) < 40, text
    cls, where = _expectation(path)
    assert (f"{path.name}:{where[0]}:{where[1]}: " if where else f"{path.name}: ") in text, text


@pytest.mark.slow  # a third-party model
def test_a_target_of_the_wrong_length_is_located_at_get_batch_on_a_hugging_face_model(tmp_path):
    """A target one token short, under the default loss, on a model whose forward cannot run
    on meta (Hugging Face LLaMA: the step on meta stops before the loss): the tracer meets the
    fault, and it is reported at ``get_batch``'s line as the step on meta reports it, not as
    "torch.export failed" with no line."""
    source = (Path(__file__).resolve().parent.parent / "examples" / "hf_llama.py").read_text()
    broken = source.replace("return data[:, :-1], data[:, 1:]", "return data[:, :-1], data[:, 2:]")
    assert broken != source
    path = tmp_path / "short_target.py"
    path.write_text(broken)
    with pytest.raises(SsdslError) as info:
        trace(load_model_file(str(path)), device="meta")
    err = info.value
    assert type(err).__name__ == "ModelFileRaised", err.render()
    line = broken.splitlines().index(
        "def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:") + 1
    assert err.span is not None and err.span.line == line, err.render()
    assert "default loss" in err.message and "batch_size" in err.message


@pytest.mark.parametrize("name", ["forward_makes_a_cpu_tensor.py",
                                  "loss_uses_a_module_constant_on_cpu.py"])
def test_a_tensor_on_another_device_is_named_as_such(name):
    """A tensor made apart from the model's (on the CPU) meeting them on meta is a device
    mismatch, not a read of values: the message says so and how to make it follow them."""
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file
    from ssdsl.trace.trial import ModelFileRaised

    with pytest.raises(ModelFileRaised) as err:
        trace(load_model_file(str(BAD / name)), device="meta")
    text = err.value.render()
    assert "made on another device" in text and "device=x.device" in text
    assert "needs tensor values" not in text
