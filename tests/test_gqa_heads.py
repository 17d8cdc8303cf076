"""Grouped-query attention under a split by heads: the query projection's heads are the key/value
heads times the query heads of each group (``heads`` x ``heads_1``), so ``along heads`` divides
at most the key/value heads. A count beyond them is refused saying so, with the split that does
work (``along heads_1``, the key/value projections replicated), which trains like the plain
model (oracle: the plain model in float64, verification's reference and ``--check``'s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssdsl.errors import SsdslError
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch
from tests.checked_run import assert_gloo_run_matches

MODEL = Path(__file__).resolve().parent / "models" / "gqa_attention.py"
ATTN = "layers.*.self_attn except layers.*.self_attn.o_proj"
PLAN = f"""plan gqa(n: int = world)
partition {ATTN} along {{dim}} into n
partition layers.*.self_attn.o_proj along in into n
replicate rest into n
assign each part i to device i
"""


def _plan(tmp_path: Path, dim: str) -> str:
    path = tmp_path / f"gqa_{dim}.ssp"
    path.write_text(PLAN.format(dim=dim))
    return str(path)


def test_heads_beyond_the_key_value_heads_are_refused_with_the_split_that_works(tmp_path):
    with pytest.raises(SsdslError) as info:
        verify_before_launch(JobSpec(str(MODEL), _plan(tmp_path, "heads")), 4)
    err = info.value
    assert type(err).__name__ == "IndivisibleError" and err.span.line == 2
    assert "2 key/value heads" in err.message and "'heads_1' 2 query heads" in err.message
    assert "along heads_1" in err.hint


@pytest.mark.parametrize("dim", ["heads", "heads_1"])
def test_either_split_into_two_is_verified(tmp_path, dim):
    got = verify_before_launch(JobSpec(str(MODEL), _plan(tmp_path, dim)), 2)
    assert got.status == "verified", got.reason
    assert got.loss == pytest.approx(got.reference_loss, rel=1e-12, abs=0)


@pytest.mark.slow  # two rank processes
def test_the_query_heads_split_trains_like_the_plain_model(tmp_path, capsys):
    assert_gloo_run_matches(capsys, MODEL, _plan(tmp_path, "heads_1"), 2)
