"""The composite stdlib plans pass every module-name parameter down to megatron_tp (finding 10
of issue 10), so a model with other names (LLaMA's self_attn, o_proj, down_proj) can use them.
The oracle is megatron_tp used alone with the same names: the same partition directives."""

from __future__ import annotations

import pytest

from ssdsl.elaborate import elaborate_file

LLAMA = {"blocks": "lm.model.layers.*", "attn": "self_attn", "attn_out": "self_attn.o_proj",
         "mlp": "mlp", "mlp_out": "mlp.down_proj"}


def _partitions(plan: str, **sets: str) -> list[str]:
    el = elaborate_file(plan, world=8, sets=sets)
    return [str(d) for d in el.directives if d.kind == "partition" and "batch" not in str(d)]


@pytest.mark.parametrize("plan, extra", [("dp_tp", {"dp": "2", "tp": "2"}),
                                         ("dp_tp_1f1b", {"dp": "2", "tp": "2", "pp": "2"})])
def test_composites_pass_every_name_to_megatron(plan: str, extra: dict) -> None:
    alone = _partitions("megatron_tp", tp="2", placed="false", **LLAMA)
    assert any("self_attn.o_proj" in d for d in alone)
    assert _partitions(plan, **extra, **LLAMA) == alone
