"""Checkpoints: a sharded save per rank, merged into a state dict the plain model loads strictly
(tied parameters included), with optimizer state; a resumed run follows the uninterrupted one.

Oracles: the plain single-device model (strict ``load_state_dict``), a plain AdamW loop written
here for the optimizer state, and the uninterrupted run's losses for the resumed run.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from ssdsl.cli import main
from ssdsl.ir.region import Region
from ssdsl.runtime.checkpoint import merge_optimizer, model_state, write_atomically
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
ADAMW64 = ["--dtype", "float64", "--optimizer", "adamw", "--lr", "0.01"]


def run_json(capsys, *argv: str) -> dict:
    code = main(["run", *argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    return out


def test_merge_puts_shards_together_and_names_tied_parameters():
    full = torch.arange(24.0).reshape(4, 6)
    halves = [Region.full((4, 6)).split(dim=0, parts=2, index=i) for i in (0, 1)]
    shards = [("wte.weight", r, r.slice_of(full)) for r in halves]
    shards.append(("wte.weight", halves[0], halves[0].slice_of(full)))  # a replica: taken once
    state = model_state(shards, aliases={"wte.weight": ("lm_head.weight",)},
                        state_keys=["lm_head.weight", "wte.weight"])
    assert list(state) == ["lm_head.weight", "wte.weight"]
    assert torch.equal(state["wte.weight"], full) and state["lm_head.weight"] is state["wte.weight"]
    opt = merge_optimizer([("w", r, {"exp_avg": r.slice_of(full), "step": torch.tensor(3.0)})
                           for r in halves])
    assert torch.equal(opt["w"]["exp_avg"], full) and float(opt["w"]["step"]) == 3.0


def test_files_are_atomic_and_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomically(tmp_path / "x.pt", {"a": torch.ones(2)})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.pt").stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]  # no temporary left behind


def _adamw_reference(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mf = load_model_file(GPT)
    model = mf.build(seed=0).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        (x,), y = mf.get_batch(step)
        opt.zero_grad()
        mf.loss(model(x), y).backward()
        opt.step()
    return model, opt


@pytest.mark.slow
def test_save_checkpoint_merge_and_resume(capsys, tmp_path):
    old = os.umask(0o022)
    try:
        whole = run_json(capsys, GPT, "dp", "--world", "2", "--steps", "4", *ADAMW64)
        saved = tmp_path / "final.pt"
        ck = tmp_path / "ck"
        first = run_json(capsys, GPT, "dp", "--world", "2", "--steps", "2", *ADAMW64,
                         "--checkpoint", str(ck), "--save", str(saved))
    finally:
        os.umask(old)
    assert first["losses"] == whole["losses"][:2]
    # --save: a plain state dict, tied lm_head.weight included, loads strictly
    model, opt = _adamw_reference(2)
    plain = load_model_file(GPT).build(seed=0).double()
    plain.load_state_dict(torch.load(saved))  # strict
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[name], rtol=1e-9, atol=1e-12)
    assert stat.S_IMODE(saved.stat().st_mode) == 0o644
    assert sorted(p.name for p in ck.iterdir()) == ["meta.json", "rank0.pt", "rank1.pt"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in ck.iterdir())

    # merge: the model and AdamW's moments of the plain loop
    merged_path = tmp_path / "merged.pt"
    assert main(["merge", str(ck), "-o", str(merged_path)]) == 0
    merged = torch.load(merged_path, weights_only=False)
    assert "wrote" in capsys.readouterr().out
    plain.load_state_dict(merged["model"])
    assert merged["step"] == 2
    names = {p: n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        got = merged["optimizer"][names[p]]
        torch.testing.assert_close(got["exp_avg"], state["exp_avg"], rtol=1e-9, atol=1e-14)
        torch.testing.assert_close(got["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-9, atol=1e-18)
        assert float(got["step"]) == float(state["step"])

    # resume under the same plan: the uninterrupted trajectory, and the reference's (--check)
    resumed = run_json(capsys, GPT, "dp", "--world", "2", "--steps", "4", *ADAMW64,
                       "--resume", str(ck), "--check")
    assert resumed["first_step"] == 2 and resumed["ok"] is True
    for got, want in zip(resumed["losses"], whole["losses"][2:], strict=True):
        assert abs(got - want) <= 1e-12 * abs(want)
    # ... and under another plan and world: regions are re-cut from the merged tensors
    other = run_json(capsys, GPT, "megatron_tp", "--world", "2", "--steps", "4", *ADAMW64,
                     "--resume", str(ck), "--check")
    assert other["ok"] is True
    for got, want in zip(other["losses"], whole["losses"][2:], strict=True):
        assert abs(got - want) <= 1e-9 * abs(want)


def test_resume_that_trains_nothing_is_refused(capsys, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "meta.json").write_text(json.dumps({"version": 1, "world": 1, "step": 5}))
    assert main(["run", GPT, "dp", "--steps", "5", "--resume", str(ck)]) == 2
    assert "has trained 5 steps already" in capsys.readouterr().err
    assert main(["run", GPT, "dp", "--steps", "5", "--resume", str(tmp_path / "none")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def test_check_needs_a_checkpoint_not_a_state_dict(capsys, tmp_path):
    state = tmp_path / "w.pt"
    torch.save(load_model_file(GPT).build(seed=0).state_dict(), state)
    assert main(["run", GPT, "dp", "--steps", "2", "--resume", str(state), "--check"]) == 2
    assert "is a state dict, not a checkpoint" in capsys.readouterr().err


def test_paths_that_cannot_work_are_refused_before_training(capsys, tmp_path):
    """A --checkpoint that is a file, a --metrics or --checkpoint under a file, a --resume file
    that is no state dict: exit status 2 and a message, before anything runs, and the user's
    files as they were. Oracle: the files' own bytes, read back."""
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes")
    cases = [(["--checkpoint", str(mine)], "is a file, not a directory"),
             (["--checkpoint", str(mine / "ck")], "cannot write into"),
             (["--metrics", str(mine / "m.jsonl")], "cannot write into"),
             (["--resume", str(mine)], "is neither a checkpoint nor a state dict")]
    for flags, says in cases:
        assert main(["run", GPT, "dp", "--steps", "2", "--no-verify", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
    torch.save([1, 2], tmp_path / "list.pt")
    assert main(["run", GPT, "dp", "--steps", "2", "--resume", str(tmp_path / "list.pt")]) == 2
    assert "holds a list, not a state dict" in capsys.readouterr().err
    assert mine.read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.pt", "notes.txt"]
