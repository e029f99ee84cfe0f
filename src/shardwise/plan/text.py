"""Numbers in the planner's words: counts in human units, FLOP rates at a readable scale, plurals."""

from __future__ import annotations


def count(n: float) -> str:
    """A parameter (or token) count in human units: 1.34M, 7.62B, 350M, 1.2T, 900."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale * 0.9995:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def flops(rate: float) -> str:
    """A FLOP/s rate at the scale that keeps it readable: 989 TFLOP/s, 72 GFLOP/s, 850 MFLOP/s."""
    for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s")):
        if rate >= scale * 0.9995:
            return f"{rate / scale:.3g} {unit}"
    return f"{rate:.3g} FLOP/s"


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 rank', '2 ranks' ('1 node(s)' never)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def size(nbytes: float) -> str:
    """Bytes in GiB, or MiB under 1 GiB: 2.1 GiB, 870.3 MiB."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
