"""What a generated module imports: the constructors its instruction constants are written with.

Each instruction class under its kind (``comm``, ``begin``...), and ``R`` (a region), ``S`` (a
call slot), ``LocalCall``, ``Coll``, ``P2P``, ``Msg``, ``Span`` and ``device``, as the text form of
programs (``ssdsl.lower.text``) writes them.
"""

from __future__ import annotations

import torch

from ssdsl.ir.region import Region as R  # noqa: N814 - the short name the text form uses
from ssdsl.lower.instr import BY_KIND, Coll, Msg, P2P
from ssdsl.ops.core import LocalCall, Slot as S  # noqa: N814
from ssdsl.source import Span

device = torch.device
globals().update(BY_KIND)

__all__ = ["Coll", "LocalCall", "Msg", "P2P", "R", "S", "Span", "device", *BY_KIND]
