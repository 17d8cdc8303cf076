"""IR values shared by the phases: the traced graph (``graph``), sub-tensor regions (``region``)
and layouts (``layout``). Import the submodule you need."""
