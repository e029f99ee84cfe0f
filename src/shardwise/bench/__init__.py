"""`shardwise bench`: run several strategies side by side on this machine and report
measured against predicted.

    command.py   the `bench` subcommand: flags -> one BenchSpec, then run + report
    runner.py    one strategy = one `python -m shardwise train ...` subprocess (same launcher,
                 same loop as `train`), with its failure classified (does not fit / failed)
    measure.py   metrics.jsonl -> per-strategy statistics over the counted steps
    predict.py   the planner's numbers for the same config ("n/a" when there is no planner)
    report.py    report.json, report.md (table + verdict), report.png, the terminal table
"""
