from shardwise.phases import hold_full_gc

hold_full_gc()  # while the process imports; released once it has started its real work (phases.py)

from shardwise.cli import main  # noqa: E402

code = main()
if code == 0:
    from shardwise.phases import exit_without_teardown

    exit_without_teardown(0)  # nothing is left to do; skip the interpreter's teardown
raise SystemExit(code)
