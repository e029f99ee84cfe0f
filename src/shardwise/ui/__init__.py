"""`shardwise ui`: a local web page to plan, launch, watch and compare runs (docs/ui.md)."""
