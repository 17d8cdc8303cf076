"""Pictures of a simulated schedule: a compact text timeline (rich, coloured) and an SVG file.

Both show devices down and time across. Forwards are light, backwards dark, in one hue per
micro-batch, so a micro-batch can be followed down the pipeline and back; idle time (the bubble)
is dots in text and hatched grey in SVG. The SVG is written by hand: no plotting dependency.

Text form, one slot per ``slot`` time units (default: the shortest unit)::

    time   0           5
    dev 0  F0 F1 .  .  B0=== B1===
    dev 1  .  F0 F1 B0=== B1=== .
"""

from __future__ import annotations

import colorsys
import math
from collections.abc import Sequence
from fractions import Fraction
from html import escape

from rich.text import Text

from ssdsl.schedule.simulate import Event, SimResult
from ssdsl.schedule.units import Pass, Unit

_FILL = {Pass.F: "-", Pass.B: "=", Pass.I: "-", Pass.W: "~"}


def colour(unit: Unit, microbatches: int, chunk: int = 0) -> str:
    """``#rrggbb`` for ``unit``: hue by micro-batch, light for forward, dark for backward passes;
    the second chunk of a device (interleaved schedules) is paler and less saturated, so its
    boxes differ from the first chunk's of the same micro-batch."""
    hue = (unit.mb * 0.618034) % 1.0  # golden-ratio steps keep neighbours apart for any count
    light = {Pass.F: 0.78, Pass.B: 0.42, Pass.I: 0.52, Pass.W: 0.32}[unit.kind]
    sat = 0.65
    if chunk % 2:
        light, sat = min(0.9, light + 0.1), 0.35
    r, g, b = colorsys.hls_to_rgb(hue, light, sat)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def _label(unit: Unit, result: SimResult) -> str:
    """``F3`` when each device hosts one stage, else the full unit (``2F3``)."""
    g = result.schedule.stages
    if g.num_stages == g.num_devices:
        return f"{unit.kind.value}{unit.mb}"
    return str(unit)


def _slot(result: SimResult) -> Fraction:
    durations = {Fraction(e.end - e.start).limit_denominator(1000)
                 for evs in result.events for e in evs}
    durations.discard(Fraction(0))
    if not durations:
        return Fraction(1)
    # The largest slot that divides every duration, so each unit fills whole cells.
    num = math.gcd(*(d.numerator * (math.lcm(*(x.denominator for x in durations)) // d.denominator)
                     for d in durations))
    return Fraction(num, math.lcm(*(d.denominator for d in durations)))


def _cells(t: float, slot: Fraction) -> int:
    return round(Fraction(t).limit_denominator(1000) / slot)


def summary(result: SimResult) -> str:
    """One line of figures: bubble, makespan and peak activations per device."""
    peaks = " ".join(str(p) for p in result.peak_activations)
    return (f"makespan {result.makespan:g}, bubble {result.bubble_ratio:.1%} of device time "
            f"(idle/busy {result.bubble_overhead:.1%}), peak activations per device: {peaks}")


def row_names(result: SimResult, groups: Sequence[Sequence[int]] | None = None) -> list[str]:
    """A name per row: ``dev d``, or with the devices each pipeline rank stands for (``groups``,
    ``Lowered.groups``) ``dev 2`` / ``devs 0..4`` (half-open, as in plans: 0, 1, 2, 3)."""
    if groups is None:
        return [f"dev {d}" for d in range(result.num_devices)]
    return [f"dev {g[0]}" if len(g) == 1 else f"devs {ranges_text(g)}" for g in groups]


def ranges_text(ids: Sequence[int]) -> str:
    """``0..4`` (half-open: 0 to 3) for a run of consecutive ids, else ``0,2,5``."""
    ids = sorted(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1] + 1}"
    return ",".join(map(str, ids))


def _chunks(result: SimResult, device: int) -> dict[int, int]:
    """Stage -> its position among the stages of ``device`` (the chunk of an interleaved one)."""
    return {s: i for i, s in enumerate(result.schedule.stages.stages_on(device))}


def timeline_text(result: SimResult, *, slot: float | None = None,
                  names: Sequence[str] | None = None) -> Text:
    """The timeline as rich ``Text`` (``.plain`` for the uncoloured form); ``names``: a label per
    row (default ``dev d``)."""
    q = Fraction(slot).limit_denominator(1000) if slot else _slot(result)
    labels = [_label(e.unit, result) for evs in result.events for e in evs]
    width = max((len(s) for s in labels), default=2) + 1
    names = list(names) if names is not None else row_names(result)
    head = max(names, key=len)
    total = _cells(result.makespan, q)
    out = Text()
    out.append(_axis(total, q, width, len(head)) + "\n", style="dim")
    for d, evs in enumerate(result.events):
        row = Text(names[d].ljust(len(head)) + "  ")
        _row(row, evs, result, q, width, total)
        row.rstrip()
        out.append_text(row)
        out.append("\n")
    out.append(summary(result))
    return out


def _axis(total: int, q: Fraction, width: int, head: int) -> str:
    line = "time".ljust(head) + "  "
    cols = [" "] * (total * width)
    step = max(1, math.ceil(8 / width))  # a label every few cells, never overlapping
    for k in range(0, total, step):
        label = f"{float(k * q):g}"
        if all(c == " " for c in cols[k * width:k * width + len(label) + 1]):
            cols[k * width:k * width + len(label)] = label
    return (line + "".join(cols)).rstrip()


def _row(out: Text, evs: tuple[Event, ...], result: SimResult, q: Fraction, width: int,
         total: int) -> None:
    at = 0
    m = result.schedule.microbatches
    chunks = _chunks(result, evs[0].device) if evs else {}
    for e in evs:
        start, end = _cells(e.start, q), _cells(e.end, q)
        out.append(".".ljust(width) * (start - at), style="dim")
        label = _label(e.unit, result)
        n = (end - start) * width
        cell = label.ljust(n - 1, _FILL[e.unit.kind]) + " "
        fg = "black" if e.unit.kind is Pass.F else "white"
        out.append(cell[:-1], style=f"{fg} on {colour(e.unit, m, chunks.get(e.unit.stage, 0))}")
        out.append(" ")
        at = end
    out.append(".".ljust(width) * (total - at), style="dim")


# ---------------------------------------------------------------------------------------- SVG

_ROW, _GAP, _TOP = 30, 8, 58
_CHAR = 6.5  # width of a label character at 10 px


def svg_width(result: SimResult) -> int:
    """Wide enough that the shortest unit's box holds its label: the picture grows with the
    number of micro-batches instead of squeezing them (at least 700 px)."""
    shortest = min((e.end - e.start for evs in result.events for e in evs if e.end > e.start),
                   default=1.0)
    longest_label = max((len(_label(e.unit, result)) for evs in result.events for e in evs),
                        default=2)
    per_unit = _CHAR * longest_label + 8
    return max(700, math.ceil((result.makespan or 1.0) / shortest * per_unit) + 200)


def timeline_svg(result: SimResult, *, title: str = "schedule", width: int | None = None,
                 names: Sequence[str] | None = None) -> str:
    """The timeline as an SVG document (a string); ``width`` defaults to ``svg_width``."""
    names = list(names) if names is not None else row_names(result)
    left = max(64, int(_CHAR * max(len(n) for n in names)) + 20) if names else 64
    width = width or svg_width(result) + left
    span = result.makespan or 1.0
    scale = (width - left - 20) / span
    rows = result.num_devices
    height = _TOP + rows * (_ROW + _GAP) + 70
    parts = [_svg_head(width, height), _svg_title(title, result, left)]
    for d, evs in enumerate(result.events):
        y = _TOP + d * (_ROW + _GAP)
        parts.append(f'<text x="{left - 8}" y="{y + _ROW / 2 + 4}" text-anchor="end" '
                     f'class="dev">{escape(names[d])}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{span * scale:.2f}" height="{_ROW}" '
                     f'fill="url(#idle)"/>')
        chunks = _chunks(result, d)
        parts += [_svg_event(e, result, scale, y, left, chunks.get(e.unit.stage, 0))
                  for e in evs]
    parts.append(_svg_axis(result, scale, _TOP + rows * (_ROW + _GAP), left))
    chunked = any(len(result.schedule.stages.stages_on(d)) > 1 for d in range(rows))
    parts.append(_svg_legend(_TOP + rows * (_ROW + _GAP) + 36, left, chunked))
    parts.append("</svg>\n")
    return "\n".join(parts)


def _svg_head(width: int, height: int) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">\n'
            '<defs><pattern id="idle" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f1f1f1"/>'
            '<line x1="0" y1="0" x2="0" y2="6" stroke="#c8c8c8" stroke-width="2"/></pattern>'
            '<style>.dev{font-size:12px;fill:#333}.lbl{font-size:10px;pointer-events:none}'
            '.tick{font-size:10px;fill:#666}</style></defs>\n'
            f'<rect width="{width}" height="{height}" fill="white"/>')


def _svg_title(title: str, result: SimResult, left: int) -> str:
    return (f'<text x="{left}" y="22" font-size="15" font-weight="bold" fill="#222">'
            f'{escape(title)}</text>\n<text x="{left}" y="40" font-size="11" fill="#555">'
            f'{escape(summary(result))}</text>')


def _svg_event(e: Event, result: SimResult, scale: float, y: float, left: int,
               chunk: int) -> str:
    x, w = left + e.start * scale, (e.end - e.start) * scale
    fill = colour(e.unit, result.schedule.microbatches, chunk)
    text_fill = "#111" if e.unit.kind is Pass.F else "#fff"
    label = _label(e.unit, result)
    out = (f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{_ROW}" fill="{fill}" '
           f'stroke="white" stroke-width="1"><title>{e.unit} on device {e.device}: '
           f'{e.start:g} to {e.end:g}</title></rect>')
    if w >= _CHAR * len(label) + 4:  # only where the label fits (svg_width makes it fit)
        out += (f'\n<text x="{x + w / 2:.2f}" y="{y + _ROW / 2 + 4}" text-anchor="middle" '
                f'class="lbl" fill="{text_fill}">{label}</text>')
    return out


def _svg_axis(result: SimResult, scale: float, y: float, left: int) -> str:
    span = result.makespan or 1.0
    step = _nice_step(span / 12)
    out = [f'<line x1="{left}" y1="{y}" x2="{left + span * scale:.2f}" y2="{y}" '
           f'stroke="#999"/>']
    t = 0.0
    while t <= span + 1e-9:
        x = left + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 4}" stroke="#999"/>'
                   f'<text x="{x:.2f}" y="{y + 16}" text-anchor="middle" class="tick">{t:g}</text>')
        t += step
    return "\n".join(out)


def _nice_step(raw: float) -> float:
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw)


def _svg_legend(y: float, left: int, chunked: bool) -> str:
    items = [(colour(Unit(0, Pass.F, 0), 1), "forward"), (colour(Unit(0, Pass.B, 0), 1),
             "backward")]
    if chunked:
        items += [(colour(Unit(0, Pass.F, 0), 1, 1), "forward, 2nd chunk"),
                  (colour(Unit(0, Pass.B, 0), 1, 1), "backward, 2nd chunk")]
    items.append(("url(#idle)", "idle (bubble)"))
    out, x = [], left
    for fill, name in items:
        out.append(f'<rect x="{x}" y="{y - 10}" width="14" height="12" fill="{fill}" '
                   f'stroke="#999" stroke-width="0.5"/><text x="{x + 20}" y="{y}" '
                   f'class="tick">{name}</text>')
        x += 30 + 7 * len(name)
    key = "sFm: stage s, forward (F) or backward (B) of micro-batch m" if chunked else \
        "Fm / Bm: forward / backward of micro-batch m"
    out.append(f'<text x="{x + 10}" y="{y}" class="tick">one hue per micro-batch; {key}</text>')
    return "\n".join(out)
