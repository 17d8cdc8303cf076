"""How evenly ``stages into N`` cuts real models, as the cost model times the stages.

    python bench/bench_stage_balance.py [--device a100] [--case gpt2_small:4 ...]

Each case traces a model on ``meta`` at its real size (GPT-2 small with its LM head tied, seq
1024; timm's ConvNeXt-T and ViT-B/16 at 224 x 224), plans ``1f1b`` on N stages (2N
micro-batches) and times every stage's forward and backward of one micro-batch with the cost
model (``ssdsl.cost``, the device profile ``--device``): the cut itself is made by
``ssdsl.schedule.resolve.op_cost``, a cruder count, so the cost model is the judge. Prints
JSON per case: each stage's time (ms), the largest over the mean (the pipeline runs at the
pace of its slowest stage: 1.0 is a perfect cut), the largest but one (where one stage is an
indivisible bottleneck, how evenly the rest is spread), the operators per stage, the simulated
step and the largest device's peak memory. For a before/after, run it with ``PYTHONPATH`` set to an earlier checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {
    "gpt2_small": '''
        import sys; sys.path.insert(0, {root!r})
        import torch
        BATCH_SIZE = 16
        def build_model():
            from examples.gpt import build_gpt
            return build_gpt(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab=50257)
        def get_batch(step, batch_size):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 50257, (batch_size, 1025), generator=g)
            return (idx[:, :-1],), idx[:, 1:]
    ''',
    # timm models at 224 x 224, each under timm's name for it
    **{key: '''
        import sys; sys.path.insert(0, {root!r})
        import torch
        BATCH_SIZE = 32
        INPUT_DIMS = (("batch", "channels", "height", "width"),)
        def build_model():
            from examples.timm_vit import _stand_in_torchvision
            _stand_in_torchvision()
            import timm
            return timm.create_model(%r, pretrained=False)
        def get_batch(step, batch_size):
            g = torch.Generator().manual_seed(step)
            return ((torch.randn(batch_size, 3, 224, 224, generator=g),),
                    torch.randint(0, 1000, (batch_size,), generator=g))
    ''' % name for key, name in (("convnext_tiny", "convnext_tiny"),
                                  ("vit_b16", "vit_base_patch16_224"))},
}
DEFAULT = ("gpt2_small:4", "gpt2_small:8", "convnext_tiny:4", "vit_b16:4")


def measure(path: str, stages: int, device: str) -> dict:
    from ssdsl.cost import Cluster, CostOptions, estimate, plan_costs
    from ssdsl.cost.profiles import profile
    from ssdsl.elaborate import elaborate_file
    from ssdsl.materialize.program import materialize
    from ssdsl.runtime.job import schedule_plan
    from ssdsl.trace.export import trace
    from ssdsl.trace.model_file import load_model_file

    graph = trace(load_model_file(path), device="meta")
    plan = elaborate_file("1f1b", world=stages, sets={"microbatches": str(2 * stages)})
    t, lowered = schedule_plan(graph, plan)
    m = materialize(t, dtype=torch.float32, schedule=lowered)
    opts = CostOptions(profile=profile(device), cluster=Cluster(world=stages, per_node=8))
    units = plan_costs(m, opts).units
    times = [max(u.forward + u.backward for (d, s), u in units.items() if s == k)
             for k in range(stages)]
    ops = [sum(1 for op in graph.ops if t.stage_of[op.name] == k) for k in range(stages)]
    report = estimate(m, opts)
    return {"stage_ms": [round(x * 1e3, 3) for x in times],
            "max_over_mean": round(max(times) / (sum(times) / len(times)), 3),
            "others_max_ms": round(sorted(times)[-2] * 1e3, 3) if len(times) > 1 else None,
            "ops_per_stage": ops, "step_ms": round(report.step_time * 1e3, 3),
            "peak_memory_gb": round(report.peak_memory / 1e9, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="a100")
    p.add_argument("--case", nargs="*", default=list(DEFAULT), metavar="MODEL:N")
    a = p.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.case:
            name, n = case.split(":")
            path = Path(tmp) / f"{name}.py"
            path.write_text(textwrap.dedent(MODELS[name]).format(root=str(ROOT)))
            out[case] = measure(str(path), int(n), a.device)
            print(case, json.dumps(out[case]), file=sys.stderr, flush=True)
    print(json.dumps({"device": a.device, "cases": out}, indent=1))


if __name__ == "__main__":
    main()
