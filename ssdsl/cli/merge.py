"""``ssdsl merge DIR -o FILE``: a sharded checkpoint merged into one single-device state dict."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ssdsl.errors import UsageError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("merge", help="merge a sharded checkpoint into one state dict",
                              description="Merge the per-rank files of a checkpoint written by "
                              "`ssdsl run --checkpoint DIR` into one file: {'model': state dict "
                              "of the single-device model, 'optimizer': state per parameter, "
                              "'step': steps trained}. torch.load(FILE)['model'] loads into the "
                              "plain model with load_state_dict (strict).")
    p.add_argument("checkpoint", metavar="DIR", help="the checkpoint directory")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="the merged file to write (never overwritten)")
    p.add_argument("--model-only", action="store_true",
                   help="write only the model's state dict (no optimizer state)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ssdsl.cli.run import save_atomically
    from ssdsl.runtime.checkpoint import merge_checkpoint

    out = Path(args.output)
    if out.exists():
        raise UsageError(f"-o {out} exists; ssdsl does not overwrite files",
                         hint="choose a new file name")
    merged = merge_checkpoint(args.checkpoint)
    save_atomically(merged["model"] if args.model_only else merged, out)
    print(f"wrote {out}: {len(merged['model'])} tensors, step {merged['step']}")
    return 0
