"""``gc_paused``: the collector is off inside, as it was after (nested, on errors, already off)."""

import gc

import pytest

from ssdsl.gcpause import gc_paused


def test_off_inside_and_back_on_after_nesting_and_errors():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block does not turn it on under the outer one
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_left_off_when_it_was_off():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_decorated_phase_runs_with_it_off():
    from ssdsl.materialize.program import materialize
    seen = []

    @gc_paused()
    def phase():
        seen.append(gc.isenabled())

    phase()
    assert seen == [False] and gc.isenabled()
    assert materialize.__name__ == "materialize"  # the decorator keeps the phase's name


def test_keep_moves_what_the_block_made_out_of_the_collectors_view():
    before = gc.get_freeze_count()
    try:
        with gc_paused(keep=True):
            made = [[i] for i in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
    finally:
        gc.unfreeze()
