"""One message between two CPU ranks of one host: gloo's loopback TCP against shared memory
(``ssdsl.runtime.shm``), its CPU time on each side and its time from send to receipt.

    python bench/bench_p2p.py [--messages 400] [--sizes 4096 131072 1048576]

Two ranks pass one tensor back and forth ``--messages`` times (each message waits for the one
before it), once through gloo's ``isend``/``irecv`` and once through ``SameHost.send``/``recv``,
for each size in bytes (float32). Prints JSON: per way and size, the process CPU time per
message on each rank (gloo's threads included) and the wall time per message.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ssdsl.runtime.launch import launch  # noqa: E402


def worker(messages: int, sizes: list[int]) -> dict:
    import torch
    import torch.distributed as dist

    from ssdsl.runtime.dist import distributed
    from ssdsl.runtime.groups import ProcessGroups

    torch.set_num_threads(1)
    out: dict = {}
    with distributed() as ctx:
        rank, peer = ctx.rank, 1 - ctx.rank
        host = ProcessGroups.create([]).same_host
        for nbytes in sizes:
            x = torch.randn(nbytes // 4)
            for way in ("gloo", "shm"):
                if way == "shm" and host is None:
                    continue
                for _ in range(2):  # the first pass warms up; the second is reported
                    dist.barrier()
                    c0, t0 = time.process_time(), time.perf_counter()
                    for i in range(messages):
                        sending = (i % 2) == rank
                        if way == "gloo":
                            if sending:
                                dist.isend(x, peer, tag=i).wait()
                            else:
                                dist.irecv(x, peer, tag=i).wait()
                        elif sending:
                            host.send(x, peer, i)
                        else:
                            host.recv(x, peer, i)
                    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
                out[f"{way} {nbytes}"] = {"cpu_us_per_message": round(cpu / messages * 1e6, 1),
                                          "wall_us_per_message": round(wall / messages * 1e6, 1)}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=400)
    p.add_argument("--sizes", type=int, nargs="*", default=[4096, 131072, 1048576])
    args = p.parse_args(argv)
    per_rank = launch("bench_p2p:worker", nproc=2, args=(args.messages, args.sizes), timeout_s=600)
    report = {key: {"cpu_us_per_message": [r[key]["cpu_us_per_message"] for r in per_rank],
                    "wall_us_per_message": per_rank[0][key]["wall_us_per_message"]}
              for key in per_rank[0]}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
