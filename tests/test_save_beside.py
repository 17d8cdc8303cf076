"""``--save`` never overwrites and never loses trained parameters: a file that appeared at the
asked path while training is kept, and the parameters go beside it under a fresh name."""

from __future__ import annotations

from pathlib import Path

import torch

from ssdsl.cli.run import _saved_at, save_atomically


def _state() -> dict:
    return {"w": torch.arange(6, dtype=torch.float64).reshape(2, 3), "b": torch.ones(3)}


def test_free_path_is_written_as_asked(tmp_path: Path):
    path = tmp_path / "sub" / "model.pt"
    assert save_atomically(_state(), path) == path
    loaded = torch.load(path)
    assert torch.equal(loaded["w"], _state()["w"]) and torch.equal(loaded["b"], _state()["b"])
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]  # no temporary left


def test_existing_file_is_kept_and_parameters_go_beside_it(tmp_path: Path, capsys):
    path = tmp_path / "model.pt"
    path.write_bytes(b"someone else's file")
    (tmp_path / "model.1.pt").write_bytes(b"and another")
    written = save_atomically(_state(), path)
    assert written == tmp_path / "model.2.pt"
    assert path.read_bytes() == b"someone else's file"
    assert (tmp_path / "model.1.pt").read_bytes() == b"and another"
    assert torch.equal(torch.load(written)["w"], _state()["w"])
    _saved_at(path, written)
    err = capsys.readouterr().err
    assert "was not overwritten" in err and str(written) in err


def test_a_directory_that_cannot_be_made_sends_the_parameters_to_the_current_one(
        tmp_path: Path, capsys, monkeypatch):
    """The asked directory cannot exist (its parent is a file): the parameters are saved under
    the same name in the current directory, and the message says where."""
    (tmp_path / "afile").write_bytes(b"not a directory")
    asked = tmp_path / "afile" / "model.pt"
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    written = save_atomically(_state(), asked)
    assert written == here / "model.pt"
    assert torch.equal(torch.load(written)["w"], _state()["w"])
    assert (tmp_path / "afile").read_bytes() == b"not a directory"
    _saved_at(asked, written)
    err = capsys.readouterr().err
    assert "cannot be written" in err and str(written) in err
