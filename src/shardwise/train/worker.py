"""Per-rank entry point: `python -m shardwise.train.worker JOB.json` (started by torchrun's
elastic agent), or `run_job(path)` in-process for a single process."""

from __future__ import annotations

import json
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from shardwise.errors import ShardwiseError
from shardwise.rundir import atomic_write, error_dir, quiet_libraries


def run_job(path: str) -> dict:
    quiet_libraries()
    from shardwise.train.loop import Job, run

    with open(path) as fh:
        job = Job(**json.load(fh))
    return run(job)


@record
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from shardwise.train.loop import Preempted

    try:
        run_job(argv[0])
    except Preempted:
        return 0  # the checkpoint is written; the launcher says how to resume
    except ShardwiseError as e:
        # no traceback: leave the one line where the launcher reports it from
        with open(argv[0]) as fh:
            out = json.load(fh)["output_dir"]
        os.makedirs(error_dir(out), exist_ok=True)
        atomic_write(os.path.join(error_dir(out), f"rank{os.environ.get('RANK', '0')}.txt"), str(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
