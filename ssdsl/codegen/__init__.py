"""Phase 8, lowering and code generation: one readable, executable Python module per rank.

Modules, in the order a compile uses them:

- ``text``: how values appear in generated code (identifiers, literals, regions as text);
- ``emit``: ``generate_rank(m, rank, provenance)``, the module of one rank, built statement by
  statement from a ``Materialized`` (sources, adapters, local ATen calls), each statement with the
  plan line that caused it; nothing is decided here that the IR does not already say;
- ``write``: ``write_programs(dir, texts)``, atomic writes that never overwrite a file ssdsl did not
  generate.

``ssdsl.runtime.compiled`` is the support the generated modules call at run time (``rt``); it wraps
the phase-9 executor and is imported only by whoever executes generated code.
"""

from ssdsl.codegen.emit import (GENERATED_MARK, Provenance, body_digest, generate_all, generate_rank,
                                 rank_order)
from ssdsl.codegen.write import NotGenerated, default_jobs, write_programs

__all__ = ["GENERATED_MARK", "NotGenerated", "Provenance", "body_digest", "default_jobs",
           "generate_all", "generate_rank", "rank_order", "write_programs"]
