"""A worker module for the tests of :func:`syncline.testing.launcher.launch_in_process`.

``main([OUT, FAIL_RANK])`` runs as torchrun's worker would (``python -m``): rank ``FAIL_RANK``
of the first attempt exits with code 3 before it joins the group; every other rank joins it
from torchrun's environment, sums its rank + 1 over the group and writes what it saw to
``OUT/attempt{A}.rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from syncline import comm


def main(argv: list[str]) -> int:
    out, fail_rank = Path(argv[0]), int(argv[1])
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {rank} attempt {attempt} starts", flush=True)
    if rank == fail_rank and attempt == 0:
        print(f"rank {rank} fails", file=sys.stderr, flush=True)
        return 3
    comm.init_from_env(backend="gloo", timeout_s=60)
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        seen = {
            "sum": t.item(),
            "world": dist.get_world_size(),
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
            "threads": os.environ["OMP_NUM_THREADS"],
            "cwd": os.getcwd(),
            "path0": sys.path[0],
        }
        (out / f"attempt{attempt}.rank{rank}.json").write_text(json.dumps(seen))
    finally:
        comm.destroy()
    return 0
