"""Run the examples in the schedule, check and cost-count modules' docstrings (they document the API)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["ssdsl.schedule.units", "ssdsl.schedule.deps", "ssdsl.schedule.grid",
           "ssdsl.schedule.simulate", "ssdsl.schedule.stages", "ssdsl.ops.macs"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
