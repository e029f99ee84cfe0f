"""One collective's bytes on the wire and its time on a link (the sizes nccl-tests reports).

A collective of M bytes (the full, unsharded buffer) on n ranks puts 2(n-1)/n*M bytes per rank on the wire for
all-reduce and (n-1)/n*M for all-gather / reduce-scatter, and takes that many bytes divided by the bus bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.plan.calibration import value

HOST_LINK_GBPS = value("host_link_gbps")  # host <-> device, per GPU, for offload traffic


@dataclass(frozen=True)
class Links:
    """Bus bandwidths (bytes/s) and per-collective latency (s)."""

    intra_busbw: float
    inter_busbw: float  # per node, all NICs together
    intra_latency: float = 15e-6
    inter_latency: float = 40e-6
    host_bw: float = HOST_LINK_GBPS / 8 * 1e9 * 0.8


@dataclass
class Coll:
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | h2d | d2h
    bytes: float  # M, the full buffer
    ranks: int
    where: str  # intra | inter | flat | host
    per_step: float  # how many times per optimizer step
    phase: str  # fwd | bwd | step
    kind: str = ""  # "" data parallel | tp (tensor parallel, exposed) | sp (sequence parallel)

    def wire(self) -> float:
        n = self.ranks
        if self.op in ("h2d", "d2h"):
            return self.bytes
        if n <= 1:
            return 0.0
        if self.op == "ring":  # `bytes` is one exchange (summed over the layers); n-1 exchanges pass the ring
            return (n - 1) * self.bytes
        f = 2 * (n - 1) / n if self.op == "all_reduce" else (n - 1) / n
        return f * self.bytes


def coll_time(cl: Coll, links: Links) -> float:
    if cl.where == "host":
        return cl.bytes / links.host_bw
    if cl.where == "intra":
        bw, lat = links.intra_busbw, links.intra_latency
    elif cl.where == "inter":
        bw, lat = links.inter_busbw, links.inter_latency
    else:  # a flat ring across nodes runs at the slower of the two
        bw, lat = min(links.intra_busbw, links.inter_busbw), links.inter_latency
    return cl.wire() / bw + lat
