"""Run-time support of generated modules: the ``rt`` they call, and a program that runs them.

A generated ``train_step(rt, v)`` runs local ATen calls itself and hands every other instruction
of the rank's program to ``rt``, which runs it with the same handlers as the interpreter
(``ssdsl.runtime.executor.Runner``): the generated module and the interpreter differ only in who
walks the program. ``GeneratedRankProgram`` is a ``RankProgram`` whose step is the module's.

This module is part of the run phase: it executes generated code (the generator itself,
``ssdsl.codegen.emit``, does not import it).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ssdsl.codegen.emit import Provenance, body_digest, generate_rank
from ssdsl.errors import SsdslError
from ssdsl.materialize.program import Materialized
from ssdsl.runtime.executor import RankProgram, Runner


class StaleProgram(SsdslError):
    """A generated module does not match the plan it is run with (other rank, plan or model)."""


class Runtime:
    """The ``rt`` of a generated step: runs instructions with a ``Runner``'s handlers."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.device = runner.device

    def __call__(self, ins: Any) -> None:
        for _ in self.runner.visit(ins) or ():
            raise RuntimeError("a distributed runner never waits")

    def loss(self, value: torch.Tensor, count: bool) -> None:
        """Keep a loss part (counted once in the step's loss when ``count``)."""
        self.runner.record_loss(value, count)

    def recompute(self, begin: Any, body: Callable[[dict], None]) -> None:
        """Run ``body(v)`` keeping none of its activations (backward runs it again)."""
        self.runner.recomputed(begin, body)


class GeneratedRankProgram(RankProgram):
    """A ``RankProgram`` whose step runs a generated module instead of walking the program."""

    def __init__(self, m: Materialized, rank: int, model_file: Any, model: torch.nn.Module, *,
                 module: types.ModuleType, **kwargs: Any) -> None:
        check_module(module, m, rank)
        super().__init__(m, rank, model_file, model, **kwargs)
        self.module = module

    def train_batch(self, batch: tuple[torch.Tensor, ...]) -> float:
        self.opt.zero_grad(set_to_none=True)
        self.begin(batch)
        with self.whole_step():
            self.module.train_step(Runtime(self.runner), self.runner.env)
        self.runner.env, self.runner.grads = {}, {}
        return self.runner.loss_total


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
                           hint="regenerate it with `ssdsl compile` for this model and plan, "
                           "with the run's --world, --set and --dtype")
