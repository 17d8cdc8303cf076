"""Errors in the user's words: the batch and the plan's dim words, not annotation labels; one
message for one cause.

Oracle: the message text itself, checked for what a user can act on and for the internal names
(``i0``, ``n.1``) that must not leak.
"""

from __future__ import annotations

from pathlib import Path

from ssdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")


def test_batch_that_does_not_divide_names_the_batch(capsys):
    assert main(["check", GPT, "dp", "--world", "2", "--set", "n=2"]) == 0
    capsys.readouterr()
    # the batch of the trace is the model file's 8; 3 parts of 8 rows
    assert main(["check", GPT, "dp", "--world", "3"]) == 2
    err = capsys.readouterr().err
    assert "the batch has 8 rows" in err and "into 3 parts" in err
    assert "BATCH_SIZE" in err and "'i0'" not in err


def test_a_world_that_divides_nothing_is_one_message(capsys):
    assert main(["check", GPT, "megatron_tp", "--world", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("does not divide") == 1, err
    assert "'heads' of operator" in err and "h.0.attn.c_attn" in err
    assert "lines 15, 16, 17 fail the same way" in err and "--world" in err
    assert "'n.1'" not in err and "'k.0'" not in err


def test_microbatches_that_do_not_divide_the_batch(capsys):
    assert main(["check", GPT, "1f1b", "--world", "2", "--set", "microbatches=3"]) == 2
    err = capsys.readouterr().err
    assert "1f1b.ssp:" in err and "the batch has 8 rows" in err and "into 3 parts" in err
