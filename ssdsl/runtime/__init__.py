"""Phase 9, run: launcher, process group, training loop, and the check against the reference.

- ``launch``: start N local processes (or run inside ``torchrun``), collect results, fail fast.
- ``dist``: process-group setup and teardown, device per local rank, small object collectives.
- ``reference``: the single-device run a parallel run must match, and the comparison verdict.
- ``train``: the plan-independent pieces of the loop (optimizer, metrics, live view, JSON result).
"""
