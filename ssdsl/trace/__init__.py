"""Phase 3, trace: ``model.py`` to the IR graph (torch.export, non-strict).

``trace(load_model_file(path), device="meta")`` is the entry point; ``ssdsl.trace.dims`` follows
the flowing dim names; ``ssdsl.trace.model_file`` is the model-file contract.
"""

from ssdsl.trace.export import TraceError, trace  # noqa: F401
