"""Region: interval algebra and the local storage order, checked against plain tensor indexing."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ssdsl.ir.region import Region


def _fused_qkv_head_part(h: int, d: int, parts: int, index: int) -> Region:
    """Part ``index`` of a head split inside a fused (3 h d) dim, written out by hand."""
    per = h // parts
    ivs = [(q * h * d + index * per * d, q * h * d + (index + 1) * per * d) for q in range(3)]
    return Region((2, 3 * h * d), (((0, 2),), tuple(ivs)))


def test_full_and_split():
    r = Region.full((8, 6)).split(dim=0, parts=2, index=1)
    assert r.intervals == (((4, 8),), ((0, 6),))
    assert r.local_shape == (4, 6)
    assert r.numel() == 24 and r.nbytes(torch.float32) == 96
    assert not r.is_full() and Region.full((8, 6)).is_full()


def test_strided_region_shape_and_extract():
    r = _fused_qkv_head_part(h=4, d=2, parts=2, index=1)
    assert r.intervals[1] == ((4, 8), (12, 16), (20, 24))
    full = torch.arange(2 * 24.0).reshape(2, 24)
    local = r.slice_of(full)
    oracle = torch.cat([full[:, 4:8], full[:, 12:16], full[:, 20:24]], dim=1)
    assert torch.equal(local, oracle)
    # a nested split of a strided dim keeps the stride (split in local storage order)
    inner = r.split(dim=1, parts=3, index=1)
    assert inner.intervals[1] == ((12, 16),)


def test_intersect_and_empty():
    a = Region.box((10, 10), [(0, 6), (2, 10)])
    b = Region.box((10, 10), [(4, 10), (0, 3)])
    c = a.intersect(b)
    assert c.intervals == (((4, 6),), ((2, 3),))
    assert a.intersect(Region.box((10, 10), [(7, 10), (0, 10)])).is_empty()
    assert a.contains(c) and not c.contains(a)


def test_bad_regions_rejected():
    with pytest.raises(ValueError):
        Region((4,), (((0, 5),),))
    with pytest.raises(ValueError):
        Region((4,), (((0, 3), (2, 4)),))
    with pytest.raises(ValueError):
        Region.full((4,), part=(2, 2))
    with pytest.raises(ValueError):
        Region.full((6,)).split(dim=0, parts=4, index=0)


def test_equality_and_hash():
    a = Region((4,), (((0, 2), (2, 4)),))
    assert a == Region.full((4,)) and hash(a) == hash(Region.full((4,)))
    assert a != Region.full((4,), part=(0, 2))


_interval_sets = st.lists(st.integers(0, 12), min_size=2, max_size=6, unique=True).map(
    lambda xs: tuple(zip(sorted(xs)[::2], sorted(xs)[1::2])))


@settings(max_examples=60, deadline=None)
@given(outer=st.tuples(_interval_sets, _interval_sets), inner=st.tuples(_interval_sets, _interval_sets))
def test_extract_and_add_into_match_fancy_indexing(outer, inner):
    shape = (12, 12)
    big = Region(shape, outer)
    sub = big.intersect(Region(shape, inner))
    full = torch.randn(shape)
    # oracle: boolean masks on the full tensor
    def idx(ivs):
        return [i for a, b in ivs for i in range(a, b)]
    oracle = full[idx(sub.intervals[0])][:, idx(sub.intervals[1])]
    local = big.slice_of(full)
    assert torch.equal(big.extract(local, sub), oracle)
    acc = torch.zeros(big.local_shape)
    big.add_into(acc, sub, oracle)
    big.add_into(acc, sub, oracle)
    expect = torch.zeros(shape)
    rows, cols = idx(sub.intervals[0]), idx(sub.intervals[1])
    if rows and cols:
        expect[torch.tensor(rows)[:, None], torch.tensor(cols)[None, :]] = 2 * oracle
    assert torch.equal(acc, big.slice_of(expect))


@settings(max_examples=60, deadline=None)
@given(ivs=st.tuples(_interval_sets, _interval_sets))
def test_box_index_takes_what_fancy_indexing_takes_as_a_view(ivs):
    """A box region's index of slices (what the executor takes a batch input's rows with)
    gives the region's values, as a view; a region of several runs in a dim has none."""
    shape = (12, 12)
    r = Region(shape, ivs)
    full = torch.randn(shape)
    index = r.box_index()
    if not r.is_box():
        assert index is None
        return
    oracle = full[[i for a, b in r.intervals[0] for i in range(a, b)]][
        :, [i for a, b in r.intervals[1] for i in range(a, b)]]
    got = full[index] if index else full
    assert torch.equal(got, oracle)
    assert got.data_ptr() == full[r.intervals[0][0][0]:, r.intervals[1][0][0]:].data_ptr()
    assert (index == ()) == r.is_full()
