"""Errors in the user's words: the batch and the plan's dim words, not annotation labels; one
message for one cause.

Oracle: the message text itself, checked for what a user can act on and for the internal names
(``i0``, ``n.1``) that must not leak.
"""

from __future__ import annotations

from pathlib import Path

import pytest

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



def test_a_missing_dim_lists_the_dims_as_a_plan_writes_them():
    """A linear has no heads (MLP-Mixer's token MLP under megatron_tp): the error lists what the
    plan may write instead, the batch and the words ``out``/``in``, not the labels ``b0``,
    ``n``, ``k`` (nor a factor with a dot, which the grammar cannot express)."""
    from ssdsl.elaborate import elaborate_text
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file
    from ssdsl.transform import transform
    from ssdsl.transform.errors import MissingDim

    mf = load_model_file(ROOT / "examples" / "mlp.py")
    graph = trace(mf, device="meta")
    plan = elaborate_text("plan p(n: int = world)\npartition kind(linear) along heads into n\n"
                          "replicate rest into n\nassign each part i to device i\n", "p.ssp",
                          world=2)
    with pytest.raises(MissingDim) as info:
        transform(graph, plan)
    listed = info.value.message.split("its dims: ")[1].split(", ")
    assert {"batch", "out"} <= set(listed), listed  # the contracted dim: "features" here
    assert not {"b0", "n", "k"} & set(listed) and not any("." in d for d in listed), listed
