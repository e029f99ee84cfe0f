"""shardwise: plan, explain and run DDP, FSDP2 or DeepSpeed ZeRO fine-tuning from one flag."""

__version__ = "0.1.0"
