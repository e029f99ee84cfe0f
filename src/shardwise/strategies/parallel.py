"""The parallel degrees of a run and its one device mesh.

Every rank is placed on a 4-D grid, outermost first:

    dp_replicate x dp_shard x sp x tp = world size

- dp_replicate: data-parallel ranks that hold full replicas (DDP; HSDP's groups);
- dp_shard: data-parallel ranks that shard parameters/states (FSDP, ZeRO; HSDP within a group);
- sp: sequence-parallel ranks that split one sequence (models/sequence_parallel.py), itself a grid
  sp_ring x sp_ulysses: Ulysses groups of sp_ulysses consecutive sp ranks (all-to-all over heads,
  together one contiguous 1/sp_ring chunk of the sequence) and rings of sp_ring ranks (ring attention
  over the chunks, one ring per head shard); sp_ulysses = sp (no ring) unless the split says otherwise;
- tp: tensor parallel ranks that split each weight (DTensor, strategies/parallelize.py; the tp ranks of a
  data-parallel rank read the same rows and compute one loss together).

The data-parallel degree is dp_replicate x dp_shard: the sampler reads it (never the world
size). Gradients are averaged over the data-parallel ranks times the sequence-parallel ranks
(`grad_size`: each sequence rank holds other tokens of the same rows), which the loss
normalisation and DeepSpeed's batch size read; the metrics read the world size (every rank's
hardware). Ranks are laid out as `init_device_mesh` lays them (row-major), so the
data-parallel rank, sequence rank and tensor rank are arithmetic on the world rank and need no
mesh. The `DeviceMesh` itself is built on first use (it creates process groups, which is a
collective): a dimension that spans the world uses the default group, so a pure data-parallel
run has the same groups as before the mesh existed. Its dimensions are MESH_DIMS: sp is split
into (sp_ring, sp_ulysses), flattened back into the 1-D `sp_mesh`, so the sequence group and its
two subgroups all come from the one mesh (the attention reads them,
models/sequence_parallel.configure). Flattened meshes are made once and kept (`flat`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.errors import ShardwiseError

DIM_NAMES = ("dp_replicate", "dp_shard", "sp", "tp")  # the degrees users set (describe)
MESH_DIMS = ("dp_replicate", "dp_shard", "sp_ring", "sp_ulysses", "tp")  # the mesh's own dimensions


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    sp: int
    tp: int
    world_size: int
    rank: int
    device_type: str = "cpu"
    sp_ulysses: int = 0  # the Ulysses share of sp (0: all of it); sp_ring = sp / sp_ulysses
    _mesh: object = field(default=None, repr=False, compare=False)
    _flat: dict = field(default_factory=dict, repr=False, compare=False)  # flattened meshes by name

    def __post_init__(self):
        degrees = (self.dp_replicate, self.dp_shard, self.sp, self.tp)
        self.sp_ulysses = self.sp_ulysses or self.sp
        if self.sp_ulysses < 1 or self.sp % self.sp_ulysses:
            raise ShardwiseError(f"the Ulysses degree {self.sp_ulysses} must divide the sequence-parallel degree "
                                 f"{self.sp} (ulysses x ring = --sequence-parallel)")
        if min(degrees) < 1:
            raise ShardwiseError(f"parallel degrees must be >= 1, got {self.describe()}")
        if self.dp_replicate * self.dp_shard * self.sp * self.tp != self.world_size:
            raise ShardwiseError(
                f"parallel degrees {self.describe()} multiply to "
                f"{self.dp_replicate * self.dp_shard * self.sp * self.tp}, not the world size {self.world_size} "
                "(nnodes x nproc_per_node); set --sequence-parallel, --tensor-parallel and --fsdp-shard-group-size "
                "so that data-parallel x sequence x tensor = world size")

    @classmethod
    def from_config(cls, cfg, world_size: int, rank: int, local_world_size: int, device_type: str,
                    dp_split, heads: int | None = None) -> ParallelDims:
        """The degrees of this run: sp and tp from the config, data-parallel the rest of the world,
        split into (replicate, shard) by the strategy's `dp_split(cfg, dp_degree, local_world_size)`.
        `heads`: the model's attention heads, which decide how sp splits into Ulysses x ring
        (`--sp-mode`; with tensor parallelism Ulysses splits each tp rank's heads / tp)."""
        from shardwise.preflight import degrees

        sp, tp = cfg.sequence_parallel, cfg.tensor_parallel
        if sp < 1 or tp < 1:
            raise ShardwiseError(f"--sequence-parallel {sp} and --tensor-parallel {tp} must be at least 1")
        refusal = degrees.world_divides(world_size, tp, sp)  # judged before launch; the one rule, should it be met
        if refusal is not None:
            raise ShardwiseError(f"--{refusal.key.replace('_', '-')}: {refusal.message}")
        replicate, shard = dp_split(cfg, world_size // (sp * tp), local_world_size)
        ulysses = sp
        if sp > 1:
            from shardwise.models.sequence_parallel import split_degree

            ulysses, _ring = split_degree(sp, heads // tp if heads else None, getattr(cfg, "sp_mode", "ulysses"))
        return cls(replicate, shard, sp, tp, world_size, rank, device_type, ulysses)

    # -- degrees and ranks (no mesh needed) -----------------------------------------------
    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which share of the global batch it reads."""
        return self.rank // (self.sp * self.tp)

    @property
    def sp_rank(self) -> int:
        return (self.rank // self.tp) % self.sp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def sp_ring(self) -> int:
        """The ring-attention share of sp: how many contiguous chunks a sequence is cut into for the ring."""
        return self.sp // self.sp_ulysses

    @property
    def sp_shape(self) -> tuple[int, int]:
        """(sp_ring, sp_ulysses): the sequence dimension's own grid, outermost first."""
        return self.sp_ring, self.sp_ulysses

    def describe(self) -> str:
        text = " x ".join(f"{n} {d}" for n, d in zip(DIM_NAMES, (self.dp_replicate, self.dp_shard, self.sp, self.tp)))
        return text + (f" (sp = ring {self.sp_ring} x ulysses {self.sp_ulysses})" if self.sp_ring > 1 < self.sp_ulysses
                       else "")

    # -- the mesh and its groups (built on first use) -----------------------------------
    @property
    def mesh(self):
        """The one DeviceMesh of the run, dims named MESH_DIMS (size-1 dims included), with sp_ring x
        sp_ulysses flattened into "sp" (the whole sequence group)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device_type, (self.dp_replicate, self.dp_shard, *self.sp_shape, self.tp),
                                          mesh_dim_names=MESH_DIMS)
        return self._mesh

    def flat(self, name: str, dims: tuple[str, ...]):
        """The 1-D mesh of `dims` flattened under `name`, made once (a collective) and kept here: torch
        is retiring the slicing of flattened dimensions from the root mesh."""
        if name not in self._flat:
            self._flat[name] = self.mesh[dims]._flatten(name)
        return self._flat[name]

    @property
    def sp_mesh(self):
        """The whole sequence group as a 1-D mesh: sp_ring x sp_ulysses flattened."""
        return self.flat("sp", ("sp_ring", "sp_ulysses"))

    @property
    def grad_size(self) -> int:
        """The ranks gradients are averaged over: the data-parallel ranks and, within each, the
        sequence-parallel ranks (each holds other tokens of the same rows), as torchtitan's dp_cp.
        The loop scales each rank's loss by it; DeepSpeed's batch size counts it."""
        return self.dp_size * self.sp

    @property
    def shard_size(self) -> int:
        """The ranks FSDP / ZeRO shard over: dp_shard x sp (sequence-parallel ranks shard too)."""
        return self.dp_shard * self.sp

    @property
    def dp_shard_mesh(self):
        """The mesh FSDP and the ZeRO checkpoint form shard over: 1-D (dp_shard), or 2-D
        (dp_replicate, dp_shard) for HSDP. With sequence parallelism the strategies shard over
        shard_mesh instead (dp_shard x sp flattened)."""
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp_shard"]

    @property
    def shard_mesh(self):
        """The mesh FSDP and the ZeRO checkpoint form shard over: dp_shard_mesh, with the
        sequence-parallel ranks flattened into the shard dimension when sp > 1 (torchtitan's
        dp_shard_cp); (dp_replicate, dp_shard x sp) for HSDP."""
        if self.sp == 1:
            return self.dp_shard_mesh
        flat = self.flat("dp_shard_sp", ("dp_shard", "sp_ring", "sp_ulysses"))
        return self.mesh["dp_replicate", "dp_shard_sp"] if self.dp_replicate > 1 else flat

    @property
    def grad_group(self):
        """The process group gradients are averaged over (grad_size ranks): dp_group, with the
        sequence-parallel ranks when sp > 1."""
        import torch.distributed as dist

        if self.sp == 1:
            return self.dp_group
        if self.grad_size == self.world_size:
            return dist.group.WORLD
        return self.flat("dp_sp", ("dp_replicate", "dp_shard", "sp_ring", "sp_ulysses")).get_group()

    @property
    def dp_group(self):
        """The data-parallel ranks' group (gradients are averaged over grad_group: these ranks,
        and the sequence-parallel ones when sp > 1)."""
        import torch.distributed as dist

        if self.dp_size == self.world_size:
            return dist.group.WORLD  # the group the mesh would give for a dim spanning the world
        return self.flat("dp", ("dp_replicate", "dp_shard")).get_group()

    @property
    def sp_group(self):
        """The sequence-parallel group: the ranks that split one sequence."""
        return self.sp_mesh.get_group()

    @property
    def ulysses_group(self):
        """The Ulysses subgroup of the sequence group: sp_ulysses consecutive sp ranks (one contiguous
        chunk of the sequence between them), which exchange heads for sequence around attention."""
        return self.mesh["sp_ulysses"].get_group()

    @property
    def ring_group(self):
        """The ring subgroup of the sequence group: every sp_ulysses-th sp rank (the same heads, every
        chunk of the sequence), which passes keys and values round the ring."""
        return self.mesh["sp_ring"].get_group()

    @property
    def tp_group(self):
        """The tensor-parallel group: the ranks that split each weight (apply_tensor_parallel uses mesh["tp"])."""
        return self.mesh["tp"].get_group()
