"""Phase 7, lower: one frozen program per rank (``ssdsl.lower.instr``), built from a
materialized plan and its schedule (``lower_plan``), with a text form that reads back
(``program_text`` / ``parse_program``), and the one walk every backend shares (``walk``)."""

from ssdsl.lower.build import ProgramSet, localize, lower_plan, lower_rank
from ssdsl.lower.instr import Program
from ssdsl.lower.text import ProgramTextError, parse_program, program_text
from ssdsl.lower.walk import Handler, Wait, run_all, walk

__all__ = ["Handler", "Program", "ProgramSet", "ProgramTextError", "Wait", "localize",
           "lower_plan", "lower_rank", "parse_program", "program_text", "run_all", "walk"]
