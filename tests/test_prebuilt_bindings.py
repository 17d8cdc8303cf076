"""Calls through torch's generated Python bindings (``ssdsl.runtime.prebuilt.fast_binding``).

A prebuilt call takes the binding of its ATen overload only where every call that passes all the
schema's arguments reaches that overload through it. The rule is checked on overloads whose
siblings make it ambiguous, and on whole programs: with ``CHECK_BINDINGS`` every call through a
binding also runs the traced overload and must give the same tensor (value, dtype, shape and
strides); the simulated step must still be the plain model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ssdsl.runtime.prebuilt as prebuilt
from ssdsl.elaborate import elaborate_file
from ssdsl.lower import lower_plan
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.runtime.simulate import simulate_model_file
from ssdsl.runtime.verify import compare_with_model
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten


@pytest.mark.parametrize("overload, binding", [
    (aten.linear.default, torch._C._nn.linear),
    (aten.cross_entropy_loss.default, torch._C._nn.cross_entropy_loss),
    (aten.transpose.int, torch._C._VariableFunctions.transpose),
    # add.Scalar is add.Tensor with the scalar wrapped: either overload may take a number
    (aten.add.Tensor, torch._C._VariableFunctions.add),
    # told apart by the number of positional arguments
    (aten.sum.default, torch._C._VariableFunctions.sum),
    (aten.sum.dim_IntList, torch._C._VariableFunctions.sum),
])
def test_an_overload_that_its_binding_always_reaches_takes_it(overload, binding):
    assert prebuilt.fast_binding(overload) is binding


@pytest.mark.parametrize("overload", [
    aten.add.Scalar,       # a positional alpha would bind torch.add's deprecated (self, alpha, other)
    aten.split.Tensor,     # split.sizes takes the same positions (an int or a list: both values)
    aten.split.sizes,
    aten.to.dtype,         # a method only, whose Python signature is not the schema's
    aten.view.default,     # a method only
    aten.add_.Tensor,      # writes its input: no overload of it is a tensor function's
])
def test_an_overload_a_binding_may_miss_keeps_the_overload(overload):
    assert prebuilt.fast_binding(overload) is None


def test_every_left_out_argument_is_passed_with_the_schema_default():
    """The binding's own defaults are not the schema's: torch._C._nn.cross_entropy_loss(x, t)
    does not reduce, aten.cross_entropy_loss.default(x, t) takes the mean."""
    x, t = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    schema = aten.cross_entropy_loss.default._schema
    args, kwargs = prebuilt.explicit(schema, (x, t), ())
    assert args[3] == 1 and args[4] == -100 and kwargs == ()
    got = torch._C._nn.cross_entropy_loss(*args)
    assert got.shape == () and torch.equal(got, aten.cross_entropy_loss.default(x, t))
    args, kwargs = prebuilt.explicit(aten.scaled_dot_product_attention.default._schema,
                                     ("q", "k", "v"), (("scale", 0.5),))
    assert args == ("q", "k", "v", None, 0.0, False)
    assert kwargs == (("scale", 0.5), ("enable_gqa", False))
    assert prebuilt.explicit(aten.linear.default._schema, ("x",), ()) is None  # weight missing


CASES = [("gpt.py", "dp", 2, {}), ("gpt.py", "megatron_tp", 2, {}),
         ("gpt.py", "1f1b", 2, {}), ("mlp.py", "dp", 2, {}),
         ("swin.py", "dp", 2, {}), ("evoformer.py", "dp", 2, {})]


@pytest.mark.parametrize("model, plan, world, sets", CASES)
def test_calls_through_bindings_are_the_overloads_calls(monkeypatch, model, plan, world, sets):
    monkeypatch.setattr(prebuilt, "CHECK_BINDINGS", True)
    taken = []
    real = prebuilt.fast_binding

    def counted(overload):
        got = real(overload)
        if got is not None:
            taken.append(str(overload))
        return got
    monkeypatch.setattr(prebuilt, "fast_binding", counted)
    mf = load_model_file(str(ROOT / "examples" / model))
    graph = trace(mf, device="cpu", model=mf.build(seed=0))
    t, low = schedule_plan(graph, elaborate_file(plan, world=world, sets=sets))
    m = materialize(t, dtype=torch.float32, schedule=low)
    programs = lower_plan(m).programs
    sim = simulate_model_file(m, programs, mf)  # float32: the prebuilt calls run
    assert taken, "no call went through a binding"
    problems, _, _ = compare_with_model(m, mf, sim)
    assert not problems, problems
