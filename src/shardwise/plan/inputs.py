"""Turn a Config (and optional hardware facts from flags) into a planner Job and Setup."""

from __future__ import annotations

from shardwise import hardware
from shardwise.errors import ShardwiseError
from shardwise.plan import text
from shardwise.plan.comm import HBM_BYTES_PER_S, device_mem_bw
from shardwise.plan.decide import CPU_MFU, CPU_PEAK_FLOPS, Setup
from shardwise.plan.memory import Job
from shardwise.preflight.flags import MAX_NNODES, MAX_NPROC_PER_NODE

DEFAULT_GPU = "H100"  # assumed when GPUs are given by count only


def compute_dtype(mixed_precision: str, accelerator: str) -> str:
    if mixed_precision == "auto":
        return "bf16" if accelerator == "cuda" else "fp32"
    return {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}[mixed_precision]


# bounds that no machine reaches (the config's own: a plan of a config and of flags agree); beyond them the planner's
# loops over parallel degrees would run for minutes
MAX_GPUS_PER_NODE = MAX_NPROC_PER_NODE
MAX_NODES = MAX_NNODES


def check_counts(gpus: int | None, nodes: int | None) -> None:
    """--gpus (per node) and --nodes within the bounds, where given."""
    if gpus is not None and not 1 <= gpus <= MAX_GPUS_PER_NODE:
        raise ShardwiseError(f"--gpus must be in 1..{MAX_GPUS_PER_NODE} (GPUs per node), got {gpus}")
    if nodes is not None and not 1 <= nodes <= MAX_NODES:
        raise ShardwiseError(f"--nodes must be in 1..{MAX_NODES}, got {nodes}")


def compile_on(compile_key: str, accelerator: str) -> bool:
    """config `compile`: auto is on when the planned ranks are GPUs (the engine: on with CUDA)."""
    return compile_key == "on" or (compile_key == "auto" and accelerator == "cuda")


def _ac(cfg) -> str:
    """config.checkpointing_mode: activation_checkpointing, gradient_checkpointing true meaning full."""
    mode = getattr(cfg, "activation_checkpointing", "off")
    return "full" if cfg.gradient_checkpointing and mode == "off" else mode


def reference(cfg) -> str:
    """task dpo's reference during training, as memory.Job.reference names it."""
    if getattr(cfg, "task", "sft") != "dpo" or cfg.loss_type in ("simpo", "orpo") or cfg.precompute_ref:
        return "none"
    return "model" if cfg.tuner == "full" else "adapters"


def job_from_config(cfg, setup: Setup) -> Job:
    rows = 2 if getattr(cfg, "task", "sft") == "dpo" else 1  # a pair's chosen and rejected rows share a forward
    return Job(world=setup.world, nodes=setup.nodes, micro_batch=cfg.micro_batch_size * rows, seq_len=cfg.seq_len,
               grad_accum=cfg.grad_accum, tuner=cfg.tuner, lora_r=cfg.lora.r, lora_targets=cfg.lora.targets,
               lora_dropout=cfg.lora.dropout, compute=compute_dtype(cfg.mixed_precision, setup.accelerator),
               param_dtype=cfg.param_dtype, checkpointing=_ac(cfg) in ("full", "offload"), packing=cfg.packing,
               device_mem_gib=setup.device_mem_gib, host_mem_gib=setup.host_mem_gib, accelerator=setup.accelerator,
               fused_loss=cfg.fused_loss, compile=compile_on(cfg.compile, setup.accelerator),
               sp=getattr(cfg, "sequence_parallel", 1), tp=getattr(cfg, "tensor_parallel", 1),
               sp_mode=getattr(cfg, "sp_mode", "auto"),
               selective_checkpointing=_ac(cfg) == "selective", float8=bool(getattr(cfg, "float8", False)),
               offload_checkpoints=_ac(cfg) == "offload", mlp_tiles=_tiles(cfg), reference=reference(cfg),
               task=getattr(cfg, "task", "sft"))


def _tiles(cfg) -> int:
    """config `mlp_tiles` for the planner's Job: the count, 0 for auto (resolved per job: memory.mlp_tiles)."""
    from shardwise.plan.long_context import parse_mlp_tiles

    try:
        n = parse_mlp_tiles(getattr(cfg, "mlp_tiles", "1"))
    except ValueError:
        return 1  # the config's own check refuses it
    return 0 if n == "auto" else n


def _check_flags(gpus, nodes, gpu_memory, intra_gbps, inter_gbps, mfu) -> None:
    """The hardware flags within their bounds, where given."""
    check_counts(gpus, nodes)
    if gpu_memory is not None and not 0 < gpu_memory <= 4096:
        raise ShardwiseError(f"--gpu-memory must be in GiB per GPU, between 0 and 4096, got {gpu_memory}")
    for flag, v in (("--intra-node-gbps", intra_gbps), ("--inter-node-gbps", inter_gbps)):
        if v is not None and v <= 0:
            raise ShardwiseError(f"{flag} must be > 0 (Gb/s), got {v}")
    if mfu is not None and not 0 < mfu <= 1:
        raise ShardwiseError(f"--mfu must be a fraction in (0, 1], got {mfu}")


def make_setup(hw: hardware.Hardware | None = None, *, gpus: int | None = None, nodes: int = 1,
               gpu_memory: float | None = None, gpu_type: str | None = None, intra_gbps: float | None = None,
               inter_gbps: float | None = None, mfu: float | None = None, ranks_per_node: int | None = None,
               use_doctor: bool = True) -> Setup:
    """Hardware for a plan: what is given wins, then what is measured (doctor.json), then detected, then assumed."""
    notes: list[str] = []
    _check_flags(gpus, nodes, gpu_memory, intra_gbps, inter_gbps, mfu)
    if hw is None:
        if gpus is not None and gpu_memory is not None:
            hw = hardware.Hardware("cuda", gpu_type or DEFAULT_GPU, gpus, gpu_memory, 0.0)
        else:
            hw = hardware.detect_light()
            found = f"{hw.device_count} x {hw.device_name}" if hw.device_count else "no GPU"
            notes.append(f"detected: {found}; host RAM {hw.host_memory_gib:.0f} GiB")
    if gpus is not None or gpu_memory is not None:  # GPUs given (or partly given) by flags
        accel = "cuda"
        name = gpu_type or (hw.device_name if hw.accelerator == "cuda" else DEFAULT_GPU)
        count = gpus if gpus is not None else (hw.device_count or 1)
        mem = gpu_memory if gpu_memory is not None else (hw.memory_gib if hw.accelerator == "cuda" else 80.0)
        if gpu_memory is None:
            notes.append(f"GPU memory not given: assumed {mem:.0f} GiB (--gpu-memory)")
        if gpu_type is None and hw.accelerator != "cuda":
            notes.append(f"GPU type not given: assumed {name} for peak FLOP/s and links (--gpu-type)")
        host = hw.host_memory_gib if hw.accelerator == "cuda" and hw.host_memory_gib else 0.0
        if not host:
            host = max(2 * mem * count, 256.0)
            notes.append(f"host RAM assumed {host:.0f} GiB per node (used for offload)")
    elif hw.accelerator == "cuda":
        accel, name, count, mem, host = "cuda", gpu_type or hw.device_name, hw.device_count, hw.memory_gib, hw.host_memory_gib
    else:
        accel, name = "cpu", "cpu"
        count = ranks_per_node or 2
        host = hw.host_memory_gib
        mem = host / count
        notes.append(f"CPU only: {host:.0f} GiB of host RAM split between {text.plural(count, 'rank')} "
                     f"({mem:.1f} GiB each)")
    count = ranks_per_node or count
    doctor = hardware.load_doctor() if use_doctor else None
    measured_bw = None
    peak = hardware.peak_flops(name, "bf16") if accel == "cuda" else None
    fp8 = (hardware.fp8_peak_flops(name) or 0.0) if accel == "cuda" else 0.0
    mem_bw = device_mem_bw(name) if accel == "cuda" else HBM_BYTES_PER_S  # (the CPU plans no memory-bound passes)
    if doctor and doctor.get("accelerator") == accel:
        ar = (doctor.get("collectives") or {}).get("all_reduce") or []
        if ar and intra_gbps is None and nodes == 1:
            measured_bw = max(r["busbw_gbps"] for r in ar) / 8 * 1e9
            notes.append(f"intra-node bus bandwidth measured by `shardwise doctor`: {measured_bw * 8 / 1e9:.1f} Gb/s "
                         f"({text.plural(doctor.get('world_size'), 'rank')}, {doctor.get('backend')})")
        if accel == "cpu" and doctor.get("matmul_gflops"):
            peak = doctor["matmul_gflops"] * 1e9
            notes.append(f"CPU matmul rate measured by `shardwise doctor`: {peak / 1e9:.0f} GFLOP/s per rank")
    if peak is None:
        if accel == "cpu":
            peak = CPU_PEAK_FLOPS
            notes.append(f"CPU matmul rate assumed {peak / 1e9:.0f} GFLOP/s per rank (run `shardwise doctor` to measure)")
        else:
            peak = hardware.peak_flops(DEFAULT_GPU, "bf16")
            fp8 = hardware.fp8_peak_flops(DEFAULT_GPU)  # float8 and memory too: the GPU is planned as the default one
            mem_bw = device_mem_bw(DEFAULT_GPU)
            notes.append(f"peak FLOP/s of '{name}' unknown: assumed {DEFAULT_GPU} ({text.flops(peak)})")
    if intra_gbps is not None:
        intra, intra_label = intra_gbps, f"given: {intra_gbps:g} Gb/s"
    else:
        key = hardware.default_intra_link(name if accel == "cuda" else "cpu", getattr(hw, "nvlink", None))
        intra, intra_label = hardware.LINKS_GBPS[key]
        if measured_bw is None:
            notes.append(f"intra-node link assumed: {intra_label} (--intra-node-gbps to change)")
    if inter_gbps is not None:
        inter, inter_label = inter_gbps, f"given: {inter_gbps:g} Gb/s per node"
    else:
        inter, inter_label = hardware.LINKS_GBPS["net100"]
        if nodes > 1:
            notes.append(f"inter-node link assumed: {inter_label} (--inter-node-gbps 25/100/400/3200 to change)")
    if mfu is None:
        mfu = CPU_MFU if accel == "cpu" else None  # GPU: by the job (compiled or eager blocks), Setup.mfu_for
    return Setup(gpus_per_node=count, nodes=nodes, accelerator=accel, device_name=name, device_mem_gib=mem,
                 host_mem_gib=host, intra_gbps=intra, intra_label=intra_label, inter_gbps=inter,
                 inter_label=inter_label, peak_flops=peak, mfu=mfu, notes=notes, measured_busbw=measured_bw,
                 fp8_peak_flops=fp8, device_mem_bw=mem_bw)
