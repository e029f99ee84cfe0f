"""`single`: one process, no wrapping."""

from shardwise.strategies.base import Strategy


class SingleStrategy(Strategy):
    name = "single"
