"""Phase 3, trace: ``model.py`` to the IR graph (torch.export, non-strict)."""
