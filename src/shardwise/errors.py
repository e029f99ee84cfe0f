"""The one exception type for errors a user can cause (bad config, bad data, missing files).

The CLI prints its message on one line and exits non-zero; no traceback unless --debug.
A message says what is wrong, where (file:line, flag or key) and what to do.
"""


class ShardwiseError(Exception):
    """A user-facing error: one line, what + where + what to do."""

    exit_code = 2


class NothingToDo(ShardwiseError):
    """Not an error: there is nothing to do (a finished run resumed again). The CLI prints the message as a note and
    exits 0, having written nothing."""

    exit_code = 0
