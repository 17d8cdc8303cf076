"""Peak activation memory of co-shard against megatron_tp at the same devices (issue 11).

    python bench/bench_coshard.py [--model examples/swin.py] [--world 2] [--colocate 2]

For each plan, one training step of every rank runs in this process from the lowered programs
(the runner and the walk of ``ssdsl.runtime.simulate``, which the ranks' executor shares), in
float32, under ``torch.autograd.graph.saved_tensors_hooks``: per rank, the bytes of the tensors
autograd saves for backward that are alive (a storage counted once, however many saves share
it; parameters and buffers left out), and their peak over the step. Recomputed regions run
through torch's *reentrant* checkpoint here: it saves the region's inputs and, in backward,
the recomputed activations, and the hooks see both; the executor's non-reentrant checkpoint
keeps the same tensors alive (its inputs, then one region's recomputation at a time) but hides
them from outer hooks, so it would read as zero. The loss and every gradient of the measured
step are compared with the plain model (``compare_with_model``), so the substitute is checked.

Plans: megatron_tp (no recompute), megatron_tp with the same ``recompute`` statement co-shard
makes (what recompute alone gives), and coshard with ``--colocate`` parts per device. Prints
JSON; ``ratio`` is co-shard's peak over megatron_tp's (the worst rank of each).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"examples/swin.py": {"blocks": "stages.*.*", "attn_out": "attn.proj",
                              "mlp_out": "mlp.2"},
         "examples/gpt.py": {}}


class SavedBytes:
    """Bytes of saved tensors alive, per rank; ``rank`` is the rank whose walk runs now."""

    def __init__(self, skip: set[int]) -> None:
        self.skip, self.rank = skip, 0
        self.live: dict[tuple[int, int], list[int]] = {}
        self.total: dict[int, int] = defaultdict(int)
        self.peak: dict[int, int] = defaultdict(int)

    def pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.skip or storage.nbytes() == 0:
            return t
        key = (self.rank, ptr)
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [0, storage.nbytes()]
            self.total[self.rank] += entry[1]
            self.peak[self.rank] = max(self.peak[self.rank], self.total[self.rank])
        entry[0] += 1
        return _Saved(self, key, t)

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Saved) else held

    def release(self, key: tuple[int, int]) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            self.total[key[0]] -= entry[1]


class _Saved:
    def __init__(self, tracker: SavedBytes, key: tuple[int, int], t) -> None:
        self.tracker, self.key, self.t = tracker, key, t

    def __del__(self) -> None:
        self.tracker.release(self.key)


def _tagged(tracker: SavedBytes, rank: int, walk):
    """``walk`` with ``tracker.rank`` set to ``rank`` whenever it runs."""
    while True:
        tracker.rank = rank
        try:
            w = next(walk)
        except StopIteration:
            return
        yield w


def measure(model: str, plan: str, sets: dict, world: int) -> dict:
    import torch
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    import ssdsl.runtime.executor as executor
    from ssdsl.ir.interpret import with_step_values
    from ssdsl.lower import lower_plan, run_all, walk
    from ssdsl.lower.walk import Exchange
    from ssdsl.runtime.comm import combine
    from ssdsl.runtime.executor import init_state
    from ssdsl.runtime.job import JobSpec, plan_job
    from ssdsl.runtime.reference import to_dtype
    from ssdsl.runtime.simulate import Simulation, SimRunner
    from ssdsl.runtime.verify import compare_with_model

    spec = JobSpec(str(ROOT / model), plan, tuple((k, str(v)) for k, v in sets.items()))
    mf, m, full = plan_job(spec, world)
    programs = lower_plan(m).programs
    exchange = Exchange(combine)
    inputs, target = mf.get_batch(0, None)
    batch = with_step_values(m.transformed.graph, to_dtype((*inputs, target), m.dtype))
    runners = {}
    for p in programs:
        runners[p.rank] = SimRunner(p.rank, init_state(m, p.rank, full), dtype=m.dtype,
                                    exchange=exchange)
        runners[p.rank].start(batch)
    skip = {t.untyped_storage().data_ptr() for r in runners.values()
            for t in (*r.state.leaves.values(), *r.state.fixed.values())}
    tracker = SavedBytes(skip)
    plain = executor.checkpoint
    executor.checkpoint = lambda fn, *a, use_reentrant=False: torch_checkpoint(
        fn, *a, use_reentrant=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            run_all({p.rank: _tagged(tracker, p.rank, walk(p, runners[p.rank]))
                     for p in programs}, exchange)
    finally:
        executor.checkpoint = plain
    loss = next(r.loss_total for r in runners.values() if r.loss_total is not None)
    grads = {rank: {k: v.grad.detach().clone() for k, v in r.state.leaves.items()
                    if v.grad is not None} for rank, r in runners.items()}
    problems, ref_loss, worst = compare_with_model(m, mf, Simulation(loss, grads))
    return {"plan": plan, "sets": sets, "peak_saved_bytes": dict(tracker.peak),
            "worst_rank_bytes": max(tracker.peak.values()), "loss": loss,
            "reference_loss": ref_loss, "max_grad_error": worst, "matches": not problems,
            "problems": problems[:3]}


def _recomputed_megatron(names: dict, folder: Path) -> str:
    """megatron_tp with co-shard's recompute statement: what recompute alone gives."""
    b = names.get("blocks", "h.*")
    a, mlp = names.get("attn", "attn"), names.get("mlp", "mlp")
    args = ", ".join(f'{k}="{v}"' for k, v in names.items())
    path = folder / "megatron_recompute.ssp"
    path.write_text(f"plan megatron_recompute()\nuse megatron_tp({args})\n"
                    f"recompute {b}.{a} | {b}.{mlp}\n")
    return str(path)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="examples/swin.py")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--colocate", type=int, default=2)
    args = ap.parse_args(argv)
    names = NAMES.get(args.model, {})
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(args.model, "megatron_tp", names, args.world),
                measure(args.model, _recomputed_megatron(names, Path(tmp)), {}, args.world),
                measure(args.model, "coshard", {**names, "colocate": args.colocate},
                        args.world)]
    mega, recomputed, co = (r["worst_rank_bytes"] for r in runs)
    print(json.dumps({"model": args.model, "world": args.world, "colocate": args.colocate,
                      "runs": runs, "ratio": co / mega,
                      "ratio_to_megatron_with_recompute": co / recomputed,
                      "all_match": all(r["matches"] for r in runs)}, indent=2))
    return 0 if all(r["matches"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
