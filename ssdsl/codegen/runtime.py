"""Run-time support of generated modules: the ``rt`` they call, and a program that runs them.

A generated ``forward(rt, batch)`` only names things (a region of a batch tensor, a parameter
shard, an adapter by its position in ``Materialized.edges``); ``Runtime`` turns those names into
tensors and collectives with the same functions the interpreter uses (``Region.slice_of``, the
executor's shards, ``ssdsl.runtime.comm.run_adapter``). ``GeneratedRankProgram`` is a
``RankProgram`` whose forward is the generated one, so the training step, the gradient reducer and
the optimizer are shared with the interpreter and only the forward differs.

This module depends on the run phase (``ssdsl.runtime``): it is what executes generated code, and
the generator itself (``ssdsl.codegen.emit``) does not import it.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch

from ssdsl.codegen.emit import Provenance, body_digest, generate_rank
from ssdsl.codegen.text import parse_region
from ssdsl.errors import SsdslError
from ssdsl.materialize.program import Materialized
from ssdsl.runtime.comm import run_adapter
from ssdsl.runtime.executor import RankProgram, scale_grad


class StaleProgram(SsdslError):
    """A generated module does not match the plan it is run with (other rank, plan or model)."""


class Runtime:
    """The ``rt`` of one forward call on one rank: takes sources, runs adapters, keeps tokens.

    ``tokens`` collects what a rank that only sends in an adapter gets back; backward must start
    from them too, so that the gradients sent to this rank are received.
    """

    def __init__(self, program: RankProgram, *, device: torch.device) -> None:
        self.program = program
        self.rank = program.rank
        self.device = device
        self.tokens: list[torch.Tensor] = []
        self._edges = list(program.m.edges.values())
        self._tensors = program.graph.tensors

    def take(self, full: torch.Tensor, region: str) -> torch.Tensor:
        """The ``region`` (text form, ``"0:4 x 0:32"``) of a whole batch tensor."""
        return parse_region(region, tuple(full.shape)).slice_of(full)

    def param(self, name: str, region: str, scale: float = 1.0) -> torch.Tensor:
        """This rank's shard of parameter ``name``; its gradient counts ``scale`` times."""
        leaf = self.program.state.leaves[(name, self._region(name, region))]
        return scale_grad(leaf, scale)

    def buffer(self, name: str, region: str) -> torch.Tensor:
        """This rank's region of a buffer or lifted constant (no gradient)."""
        return self.program.state.fixed[(name, self._region(name, region))]

    def adapter(self, edge: int, local: torch.Tensor | None) -> torch.Tensor | None:
        """Join adapter number ``edge`` with this rank's producer tensor (``None``: none).

        Returns this rank's consumer tensor; a rank that only sends gets ``None`` and its token
        goes to ``tokens``.
        """
        ad = self._edges[edge].adapter
        got = run_adapter(ad, self.rank, local, groups=self.program.groups)
        if any(d == self.rank for d, _ in ad.consumers):
            return got
        if got is not None:
            self.tokens.append(got)
        return None

    def _region(self, name: str, text: str):
        return parse_region(text, tuple(self._tensors[name].shape))


class GeneratedRankProgram(RankProgram):
    """A ``RankProgram`` whose forward runs a generated module instead of interpreting the IR."""

    def __init__(self, m: Materialized, rank: int, model_file: Any, model: torch.nn.Module, *,
                 module: types.ModuleType, **kwargs: Any) -> None:
        check_module(module, m, rank)
        super().__init__(m, rank, model_file, model, **kwargs)
        self.module = module

    def forward(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, list]:
        device = batch[0].device if batch else torch.device("cpu")
        rt = Runtime(self, device=device)
        return self.module.forward(rt, batch), rt.tokens


def load_module(text: str, *, filename: str = "<generated>") -> types.ModuleType:
    """Execute generated source as a fresh module (not registered in ``sys.modules``)."""
    module = types.ModuleType(Path(filename).stem)
    module.__file__ = filename
    module.__ssdsl_source__ = text  # kept so that check_module can see hand edits
    exec(compile(text, filename, "exec"), module.__dict__)  # noqa: S102 - our own output
    return module


def load_program_file(path: str | Path) -> types.ModuleType:
    """``load_module`` of a file written by ``ssdsl compile``."""
    return load_module(Path(path).read_text(encoding="utf-8"), filename=str(path))


def check_module(module: types.ModuleType, m: Materialized, rank: int) -> None:
    """Refuse a module generated for another rank, world or plan than ``m`` and ``rank``."""
    name = getattr(module, "__file__", "<generated>")
    world = m.transformed.world
    if getattr(module, "RANK", None) != rank or getattr(module, "WORLD", None) != world:
        raise StaleProgram(f"{name} is the program of rank {getattr(module, 'RANK', '?')} of "
                           f"{getattr(module, 'WORLD', '?')}, not of rank {rank} of {world}",
                           hint="load rank<N>.py on rank N, compiled with the same --world")
    source = getattr(module, "__ssdsl_source__", None)
    if source is not None and body_digest(source) != getattr(module, "DIGEST", None):
        raise StaleProgram(f"{name} was edited after it was generated (digest mismatch)",
                           hint="regenerate it with `ssdsl compile`; generated files are not "
                           "meant to be edited")
    prov = Provenance("", "", "", (), world)
    expected = body_digest(generate_rank(m, rank, prov))
    if getattr(module, "DIGEST", None) != expected:
        raise StaleProgram(f"{name} was generated from another plan or model than the one "
                           "being run (digest mismatch)",
                           hint="regenerate it with `ssdsl compile` for this model and plan")
