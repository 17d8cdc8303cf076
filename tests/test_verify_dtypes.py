"""``check --verify`` runs adapters of mask and index tensors (bool, int64) on random values of
their own dtype and compares them as such (finding 9 of issue 10: "Bool did not match Long").
The oracle is ``expected_values``: slices of full random tensors, not the adapter's steps."""

from __future__ import annotations

import attrs
import pytest
import torch

from ssdsl.ir.layout import Layout
from ssdsl.materialize.plan import plan_adapter
from ssdsl.runtime.adapters import verify_adapter


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float64])
def test_gather_and_chunk_of_non_float_tensors_verify(dtype: torch.dtype) -> None:
    split = Layout.build((4, 8), [0, 1], d=(2, 1)).placements()
    whole = Layout.build((4, 8), [0, 1], r=2).placements()
    for src, dst in ((split, whole), (whole, split)):
        adapter = plan_adapter((4, 8), dtype, src, dst)
        assert verify_adapter(adapter, atol=0.0) == []


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_a_wrong_region_of_a_mask_is_found(dtype: torch.dtype) -> None:
    split = Layout.build((4, 8), [0, 1], d=(2, 1)).placements()
    whole = Layout.build((4, 8), [0, 1], r=2).placements()
    adapter = plan_adapter((4, 8), dtype, whole, split)
    # consumers swapped: each device gets the other's rows
    wrong = attrs.evolve(adapter, consumers=tuple((1 - d, r) for d, r in adapter.consumers))
    assert any("wrong values" in p for p in verify_adapter(wrong, atol=0.0))
