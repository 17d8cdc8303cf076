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
from fractions import Fraction
from html import escape

from rich.text import Text

from ssdsl.schedule.simulate import Event, SimResult
from ssdsl.schedule.units import Pass, Unit

_FILL = {Pass.F: "-", Pass.B: "=", Pass.I: "-", Pass.W: "~"}


def colour(unit: Unit, microbatches: int) -> str:
    """``#rrggbb`` for ``unit``: hue by micro-batch, light for forward, dark for backward passes."""
    hue = (unit.mb * 0.618034) % 1.0  # golden-ratio steps keep neighbours apart for any count
    light = {Pass.F: 0.78, Pass.B: 0.42, Pass.I: 0.52, Pass.W: 0.32}[unit.kind]
    r, g, b = colorsys.hls_to_rgb(hue, light, 0.65)
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


def timeline_text(result: SimResult, *, slot: float | None = None) -> Text:
    """The timeline as rich ``Text`` (``.plain`` for the uncoloured form)."""
    q = Fraction(slot).limit_denominator(1000) if slot else _slot(result)
    labels = [_label(e.unit, result) for evs in result.events for e in evs]
    width = max((len(s) for s in labels), default=2) + 1
    head = f"dev {result.num_devices - 1}"
    total = _cells(result.makespan, q)
    out = Text()
    out.append(_axis(total, q, width, len(head)) + "\n", style="dim")
    for d, evs in enumerate(result.events):
        row = Text(f"dev {d}".ljust(len(head)) + "  ")
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
    for e in evs:
        start, end = _cells(e.start, q), _cells(e.end, q)
        out.append(".".ljust(width) * (start - at), style="dim")
        label = _label(e.unit, result)
        n = (end - start) * width
        cell = label.ljust(n - 1, _FILL[e.unit.kind]) + " "
        fg = "black" if e.unit.kind is Pass.F else "white"
        out.append(cell[:-1], style=f"{fg} on {colour(e.unit, m)}")
        out.append(" ")
        at = end
    out.append(".".ljust(width) * (total - at), style="dim")


# ---------------------------------------------------------------------------------------- SVG

_ROW, _GAP, _LEFT, _TOP = 30, 8, 64, 58


def timeline_svg(result: SimResult, *, title: str = "schedule", width: int = 1100) -> str:
    """The timeline as an SVG document (a string); open it in a browser."""
    span = result.makespan or 1.0
    scale = (width - _LEFT - 20) / span
    rows = result.num_devices
    height = _TOP + rows * (_ROW + _GAP) + 70
    parts = [_svg_head(width, height), _svg_title(title, result)]
    for d, evs in enumerate(result.events):
        y = _TOP + d * (_ROW + _GAP)
        parts.append(f'<text x="{_LEFT - 8}" y="{y + _ROW / 2 + 4}" text-anchor="end" '
                     f'class="dev">dev {d}</text>')
        parts.append(f'<rect x="{_LEFT}" y="{y}" width="{span * scale:.2f}" height="{_ROW}" '
                     f'fill="url(#idle)"/>')
        parts += [_svg_event(e, result, scale, y) for e in evs]
    parts.append(_svg_axis(result, scale, _TOP + rows * (_ROW + _GAP)))
    parts.append(_svg_legend(_TOP + rows * (_ROW + _GAP) + 36))
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


def _svg_title(title: str, result: SimResult) -> str:
    return (f'<text x="{_LEFT}" y="22" font-size="15" font-weight="bold" fill="#222">'
            f'{escape(title)}</text>\n<text x="{_LEFT}" y="40" font-size="11" fill="#555">'
            f'{escape(summary(result))}</text>')


def _svg_event(e: Event, result: SimResult, scale: float, y: float) -> str:
    x, w = _LEFT + e.start * scale, (e.end - e.start) * scale
    fill = colour(e.unit, result.schedule.microbatches)
    text_fill = "#111" if e.unit.kind is Pass.F else "#fff"
    label = _label(e.unit, result)
    out = (f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{_ROW}" fill="{fill}" '
           f'stroke="white" stroke-width="1"><title>{e.unit} on device {e.device}: '
           f'{e.start:g} to {e.end:g}</title></rect>')
    if w >= 6.5 * len(label) + 4:  # only where the label fits
        out += (f'\n<text x="{x + w / 2:.2f}" y="{y + _ROW / 2 + 4}" text-anchor="middle" '
                f'class="lbl" fill="{text_fill}">{label}</text>')
    return out


def _svg_axis(result: SimResult, scale: float, y: float) -> str:
    span = result.makespan or 1.0
    step = _nice_step(span / 12)
    out = [f'<line x1="{_LEFT}" y1="{y}" x2="{_LEFT + span * scale:.2f}" y2="{y}" '
           f'stroke="#999"/>']
    t = 0.0
    while t <= span + 1e-9:
        x = _LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 4}" stroke="#999"/>'
                   f'<text x="{x:.2f}" y="{y + 16}" text-anchor="middle" class="tick">{t:g}</text>')
        t += step
    return "\n".join(out)


def _nice_step(raw: float) -> float:
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw)


def _svg_legend(y: float) -> str:
    items = [(colour(Unit(0, Pass.F, 0), 1), "forward"), (colour(Unit(0, Pass.B, 0), 1),
             "backward"), ("url(#idle)", "idle (bubble)")]
    out, x = [], _LEFT
    for fill, name in items:
        out.append(f'<rect x="{x}" y="{y - 10}" width="14" height="12" fill="{fill}" '
                   f'stroke="#999" stroke-width="0.5"/><text x="{x + 20}" y="{y}" '
                   f'class="tick">{name}</text>')
        x += 30 + 7 * len(name)
    out.append(f'<text x="{x + 10}" y="{y}" class="tick">one hue per micro-batch; hover a box '
               f'for its unit and times</text>')
    return "\n".join(out)
