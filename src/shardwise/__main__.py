from shardwise.cli import main

code = main()
if code == 0:
    from shardwise.phases import exit_without_teardown

    exit_without_teardown(0)  # nothing is left to do; skip the interpreter's teardown
raise SystemExit(code)
