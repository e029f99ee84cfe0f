"""Which tensors one compiled decoder block saves for backward, with chosen linears as torchao float8 linears: the
per-linear rules behind the planner's `float8_block_bytes` (docs/planner.md, "float8"), read on the CPU.

A one-layer Llama block (random init) is compiled with inductor and run forward under
`torch.autograd.graph.saved_tensors_hooks`; every saved tensor that is not a parameter is listed once (by storage)
with its dtype, shape and bytes per token. torch's CPU `_scaled_mm` runs the float8 matmuls, so this needs no GPU,
only torchao (`pip install torchao`, the `float8` extra). `--weights autocast` runs fp32 weights under bf16 autocast
(single, ddp); torchao's Float8Linear asks CUDA's autocast state, so on the CPU the probe answers it from the CPU's.
The same block shapes measured on the H200 (benchmarks/float8_probe.py) gave the same differences.

    python benchmarks/float8_saved_tensors.py --hidden 256 --intermediate 1024 --convert q_proj,o_proj,gate_proj,up_proj,down_proj
    python benchmarks/float8_saved_tensors.py --weights autocast --convert gate_proj,up_proj
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=384, help="differs from every width, so shapes are unambiguous")
    ap.add_argument("--convert", default="", help="comma-separated linear names (q_proj, ..., down_proj); empty: none")
    ap.add_argument("--weights", choices=("bf16", "autocast"), default="bf16")
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    a = ap.parse_args()
    import torch
    from transformers import AutoModel, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=1,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                      max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg)
    auto = a.weights == "autocast"
    if not auto:
        model = model.to(torch.bfloat16)
    else:
        cuda_state = torch.is_autocast_enabled
        torch.is_autocast_enabled = lambda *args: cuda_state(*args) if args else cuda_state("cpu")
        torch.get_autocast_gpu_dtype = lambda: torch.bfloat16
    names = {n for n in a.convert.split(",") if n}
    if names:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda m, fqn: ".layers." in f".{fqn}" and fqn.rsplit(".", 1)[-1] in names)
    block = model.layers[0]
    if not a.eager:
        block.compile()
    T = a.tokens
    x = torch.randn(1, T, a.hidden, dtype=torch.float32 if auto else torch.bfloat16, requires_grad=True)
    pe = model.rotary_emb(x, torch.arange(T)[None])
    saved: dict = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t
        return t

    def run():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=auto):
            block(x, position_embeddings=pe, attention_mask=None)

    run()  # compile
    saved.clear()
    run()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0
    for ptr, t in saved.items():
        nbytes = t.untyped_storage().nbytes()
        if ptr in params or not nbytes or ptr in (pe[0].untyped_storage().data_ptr(), pe[1].untyped_storage().data_ptr()):
            continue  # parameters, scalars (the float8 scales), the rotary tables every block shares
        total += nbytes
        print(f"  {str(t.dtype):20s} {str(tuple(t.shape)):22s} {nbytes / T:9.1f} B/token")
    print(f"total {total / T:.1f} B/token (h={a.hidden} i={a.intermediate} q={a.heads * a.head_dim} "
          f"kv={a.kv_heads * a.head_dim}) converted={sorted(names)} weights={a.weights} compiled={not a.eager}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
