"""Per-rank entry point: `python -m shardwise.train.worker JOB.json` (started by torchrun's
elastic agent), or `run_job(path)` in-process for a single process."""

from __future__ import annotations

import json
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from shardwise.errors import ShardwiseError


def run_job(path: str) -> dict:
    from shardwise.launch import quiet_libraries

    quiet_libraries()
    from shardwise.train.loop import Job, run

    with open(path) as fh:
        job = Job(**json.load(fh))
    return run(job)


@record
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        run_job(argv[0])
    except ShardwiseError as e:
        # one line; the launcher reads it from the agent's error record too
        print(f"shardwise: error: {e}", file=sys.stderr, flush=True)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
