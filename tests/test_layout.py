"""Layout recognition and its inverse, against regions written out by hand."""

import pytest

from ssdsl.ir.layout import Layout
from ssdsl.ir.region import Region


def test_build_and_placements_by_hand():
    lay = Layout.build((4, 6), [0, 1, 2, 3], d=(2, 2))
    expect = {0: [(0, 2), (0, 3)], 1: [(0, 2), (3, 6)], 2: [(2, 4), (0, 3)], 3: [(2, 4), (3, 6)]}
    for dev, reg in lay.placements():
        assert reg == Region.box((4, 6), expect[dev])


def test_recognise_megatron_partial_and_replicas():
    shape = (8, 4)
    # 2 replicas x 2 value parts, devices laid out unusually
    pl = [(5, Region.full(shape, (0, 2))), (1, Region.full(shape, (1, 2))),
          (2, Region.full(shape, (0, 2))), (7, Region.full(shape, (1, 2)))]
    lay = Layout.from_placements(shape, pl)
    assert lay is not None and lay.signature == (2, 2, 1, 1)
    assert sorted(lay.placements()) == sorted(pl)


def test_roundtrip_all_signatures():
    shape = (4, 6, 2)
    devs = [3, 9, 4, 0, 7, 1, 2, 8]
    for sig in [(8, 1, 1, 1, 1), (1, 8, 1, 1, 1), (2, 2, 2, 1, 1), (1, 1, 2, 2, 2), (2, 1, 1, 2, 2)]:
        lay = Layout.build(shape, devs, r=sig[0], v=sig[1], d=sig[2:])
        again = Layout.from_placements(shape, list(lay.placements()))
        assert again == lay


@pytest.mark.parametrize("placements", [
    # uneven blocks
    [(0, Region.box((6,), [(0, 4)])), (1, Region.box((6,), [(4, 6)]))],
    # a block missing
    [(0, Region.box((6,), [(0, 2)])), (1, Region.box((6,), [(2, 4)]))],
    # unequal replica counts
    [(0, Region.box((4,), [(0, 2)])), (1, Region.box((4,), [(0, 2)])), (2, Region.box((4,), [(2, 4)]))],
    # strided region
    [(0, Region((4,), (((0, 1), (2, 3)),))), (1, Region((4,), (((1, 2), (3, 4)),)))],
    # one device twice
    [(0, Region.box((4,), [(0, 2)])), (0, Region.box((4,), [(2, 4)]))],
])
def test_irregular_is_not_a_layout(placements):
    shape = placements[0][1].shape
    assert Layout.from_placements(shape, placements) is None


def test_bad_layout_rejected():
    with pytest.raises(ValueError):
        Layout.build((5,), [0, 1], d=(2,))
