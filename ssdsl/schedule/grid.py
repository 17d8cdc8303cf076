"""Plain-text grids of programs: devices down, program steps across.

This grid shows *order* (step k is the k-th unit a device runs), not time; ``ssdsl.schedule.picture``
draws timelines. Errors use it to show where devices are stuck: a cell can carry a mark
(``[1B0]``) and the grid can be cut to a window of steps around the marks.
"""

from __future__ import annotations

from collections.abc import Mapping

from ssdsl.schedule.units import Schedule

# Keep error messages readable when programs are thousands of units long.
_CONTEXT = 3


def longest_program(schedule: Schedule) -> int:
    return max((len(p) for p in schedule.programs), default=0)


def _window(schedule: Schedule, marks: Mapping[tuple[int, int], str],
            width: int | None) -> range:
    longest = longest_program(schedule)
    if width is None or longest <= width or not marks:
        return range(longest)
    steps = [step for _, step in marks]
    lo = max(0, min(steps) - _CONTEXT)
    hi = min(longest, max(steps) + _CONTEXT + 1, lo + max(width, 2 * _CONTEXT + 1))
    return range(lo, hi)


def program_grid(schedule: Schedule, marks: Mapping[tuple[int, int], str] | None = None, *,
                 width: int | None = 24) -> str:
    """The programs of ``schedule`` as a text grid; ``marks[(device, step)]`` replaces a cell.

    >>> from ssdsl.schedule.builders import one_f_one_b
    >>> print(program_grid(one_f_one_b(2, 2)))
    step     0    1    2    3
    dev 0  0F0  0F1  0B0  0B1
    dev 1  1F0  1B0  1F1  1B1
    """
    marks = dict(marks or {})
    steps = _window(schedule, marks, width)
    rows = [["step"] + [str(k) for k in steps]]
    for prog in schedule.programs:
        row = [f"dev {prog.device}"]
        for k in steps:
            cell = str(prog.units[k]) if k < len(prog) else ""
            row.append(marks.get((prog.device, k), cell))
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for r in rows:
        head = r[0].ljust(widths[0])
        cells = [r[c].rjust(widths[c]) for c in range(1, len(r))]
        lines.append("  ".join([head] + cells).rstrip())
    if steps and (steps.start > 0 or steps.stop < longest_program(schedule)):
        lines[0] += f"   (steps {steps.start}..{steps.stop - 1} of {longest_program(schedule)})"
    return "\n".join(lines)
