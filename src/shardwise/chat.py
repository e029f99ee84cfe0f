"""`shardwise chat DIR [--adapter DIR] [--prompt TEXT]`: talk to a trained model.

DIR is a Hugging Face model directory (a run's final/, final/merged, or an `export`
output) or a PEFT adapter directory (a LoRA run's final/: adapter_config.json; its base
is the directory recorded in it, or --base). The conversation is rendered with the
tokenizer's chat template and the answer is streamed token by token. With --prompt it
answers once on stdout and exits; without it, it reads turns from the terminal
(`/reset` forgets the conversation, `/exit` or Ctrl-D leaves).

Nothing in DIR can run code unless --trust-remote-code is given; weights are read from
safetensors only.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from shardwise.errors import ShardwiseError

ADAPTER_CONFIG = "adapter_config.json"


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="Chat with a trained model (a final/ or exported directory, or a LoRA adapter).",
                       description="Chat with a trained model: applies its chat template and streams the answer.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("dir", help="A Hugging Face model directory (final/, final/merged, an export) or a PEFT adapter "
                               "directory (a LoRA run's final/).")
    p.add_argument("--adapter", default="", help="A PEFT adapter directory to apply on top of DIR.")
    p.add_argument("--base", default="", help="Base model directory for an adapter (default: the one recorded in "
                                              "adapter_config.json).")
    p.add_argument("--prompt", default=None, help="Answer this one message and exit (no interactive session).")
    p.add_argument("--system", default="", help="A system message put before the conversation.")
    p.add_argument("--chat-template", default="", help="A chat template for a model that has none: a shipped NAME (chatml, llama3, qwen, mistral, gemma) or a Jinja FILE.")
    p.add_argument("--max-new-tokens", type=int, default=256, help="Most tokens per answer.")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 is greedy decoding.")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (with temperature > 0).")
    p.add_argument("--seed", type=int, default=0, help="Seed for sampling.")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (the first GPU if there is one).")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="Allow custom modelling or tokenizer code from the directories (off: never run their code).")
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------- loading


def _is_adapter(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def _check_model_dir(path: str, what: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ShardwiseError(f"{what} {path}: no such directory; give a run's final/ or an exported model directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ShardwiseError(f"{what} {path}: neither a model directory (config.json) nor a PEFT adapter "
                             f"directory ({ADAPTER_CONFIG})")
    from shardwise.models.load import WEIGHT_FILES

    if not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        raise ShardwiseError(f"{what} {path}: no safetensors weights (model.safetensors or its index)")
    return path


def _check_adapter_dir(path: str, what: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    if not _is_adapter(path):
        raise ShardwiseError(f"{what} {path}: no {ADAPTER_CONFIG}; give a PEFT adapter directory (a LoRA run's final/)")
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        raise ShardwiseError(f"{what} {path}: no adapter_model.safetensors (only safetensors adapters are loaded)")
    return path


def resolve_dirs(target: str, adapter: str = "", base: str = "") -> tuple[str, str | None]:
    """(base model dir, adapter dir or None), each checked; one line for anything missing."""
    if adapter:
        if _is_adapter(os.path.expanduser(target)):
            raise ShardwiseError(f"chat {target}: DIR is an adapter directory already; drop --adapter or give "
                                 "the base model as DIR")
        return _check_model_dir(base or target, "chat"), _check_adapter_dir(adapter, "--adapter")
    if not _is_adapter(os.path.expanduser(target)):
        return _check_model_dir(target, "chat"), None
    adapter_dir = _check_adapter_dir(target, "chat")
    if not base:
        from shardwise.models.lora import read_adapter_config

        base = read_adapter_config(adapter_dir, f"chat {adapter_dir}").get("base_model_name_or_path") or ""
        if not base or not os.path.isdir(base):
            raise ShardwiseError(f"chat {adapter_dir}: the base model recorded in {ADAPTER_CONFIG} "
                                 f"({base or 'none'}) is not a local directory; pass --base DIR")
    return _check_model_dir(base, "--base"), adapter_dir


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ShardwiseError(f"--device {name}: not a device; use cpu, cuda or cuda:N (or auto)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ShardwiseError(f"--device {name}: no CUDA GPU here; use --device cpu")
    return dev


def load(model_dir: str, adapter_dir: str | None, device, trust_remote_code: bool = False, model_what: str = "",
         adapter_what: str = ""):
    """(model in eval mode on `device`, tokenizer); the tokenizer comes from the adapter directory when it holds one
    (a LoRA run saves it there), else from the model. Each directory is checked as `train` checks one (tokenizer
    files, config.json, the weights whole and of config.json's shapes, the adapter's config and shapes against the
    base) before anything loads, so a problem is one line naming the directory (`model_what`, `adapter_what`) and
    the file, not an error from inside transformers or peft blamed on the other directory."""
    import torch

    from shardwise.models import load as ml
    from shardwise.models.lora import check_adapter_fits, quiet_peft, read_adapter_config

    model_what = model_what or f"chat {model_dir}"
    adapter_what = adapter_what or f"chat {adapter_dir}"
    dtype = torch.float32
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        dtype = torch.bfloat16
    adapter_cfg = read_adapter_config(adapter_dir, adapter_what) if adapter_dir else None
    # the weights against config.json first: the tokenizer is then checked against a vocab_size that is the model's
    meta = ml.check_shapes(model_dir, ml.check_weights(model_dir, model_what), trust_remote_code, model_what)
    if adapter_dir and os.path.isfile(os.path.join(adapter_dir, "tokenizer_config.json")):
        tok = ml.load_tokenizer(adapter_dir, trust_remote_code, adapter_what, vocab_dir=model_dir)
    else:
        tok = ml.load_tokenizer(model_dir, trust_remote_code, model_what)
    if adapter_dir and meta is not None:  # None: custom code or packed weights, not built here
        check_adapter_fits(adapter_dir, adapter_cfg, meta, adapter_what, f"the base model {model_dir}")
    model = ml.load_model(model_dir, dtype, trust_remote_code, model_what)
    if adapter_dir:
        from peft import PeftModel

        try:
            with quiet_peft():
                model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=False)
        except Exception as e:  # peft raises many types here
            first = str(e).splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise ShardwiseError(f"{adapter_what}: cannot apply the adapter to {model_dir} ({type(e).__name__}: "
                                 f"{first}); check that {ADAPTER_CONFIG} and adapter_model.safetensors come from one "
                                 "run and that the base model is the one it was trained from (--base)") from None
    model.config.use_cache = True
    model.to(device).eval()
    return model, tok


def check_prompt_ids(model, tok, ids, where: str = "") -> None:
    """Every token id of the prompt is one the model embeds: a tokenizer of another model is one line, not an
    IndexError from inside the embedding (the prompt's ids, not the tokenizer's size: a real tokenizer may list
    ids past the embedding that text never produces)."""
    rows = model.get_input_embeddings().num_embeddings
    top = int(ids.max()) if ids.numel() else -1
    if top >= rows:
        most = max(tok.get_vocab().values(), default=-1)
        raise ShardwiseError(f"chat{' ' + where if where else ''}: the prompt has token id {top} but the model embeds "
                             f"ids 0-{rows - 1} (config.json vocab_size {rows}); the tokenizer ({len(tok)} tokens, "
                             f"ids up to {most}) is not this model's: copy its tokenizer files from the model the "
                             "weights come from")


def set_template(tok, template: str, where: str) -> None:
    """Give the tokenizer a chat template: --chat-template NAME|FILE (the templates `train`
    ships, or a Jinja file), else the model's own."""
    from shardwise.data.templates import names, use_chat_template

    use_chat_template(tok, template)
    if not getattr(tok, "chat_template", None):
        raise ShardwiseError(f"chat {where}: the tokenizer has no chat template; pass --chat-template NAME "
                             f"({', '.join(names())}) or a Jinja FILE")
    render(tok, [{"role": "user", "content": "hi"}], where)  # a template that cannot render: one line now


def render(tok, messages: list[dict], where: str = "") -> dict:
    """The conversation tokenized through the chat template, ready for the next assistant turn; a template that
    fails (bad Jinja, or its own raise_exception for this conversation) is one ShardwiseError line."""
    from jinja2 import TemplateError

    try:
        return tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    except TemplateError as e:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ShardwiseError(f"chat{' ' + where if where else ''}: the chat template cannot render this "
                             f"conversation ({first}); fix it or pass another --chat-template") from None


# ----------------------------------------------------------------------------- talking


def answer(model, tok, messages: list[dict], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
           stream=None, where: str = "") -> str:
    """Generate the assistant's next turn, streaming its text to `stream` (a file) as it comes."""
    import torch

    enc = render(tok, messages)
    check_prompt_ids(model, tok, enc["input_ids"], where)
    ids = enc["input_ids"].to(model.device)
    mask = enc.get("attention_mask")
    mask = mask.to(model.device) if mask is not None else torch.ones_like(ids)
    stop = _stop_ids(model, tok)
    streamer = _Streamer(tok, stream) if stream is not None else None
    sample = temperature > 0
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
                             temperature=temperature if sample else None, top_p=top_p if sample else None,
                             top_k=None, eos_token_id=stop, pad_token_id=tok.pad_token_id or stop[0],
                             streamer=streamer)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _stop_ids(model, tok) -> list[int]:
    """The model's end-of-sequence ids plus the end-of-turn token of ChatML-style templates."""
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else ([ids] if ids is not None else [])
    for t in (tok.eos_token, "<|im_end|>", "<|eot_id|>", "<|end|>"):
        if t and t in tok.get_vocab():
            ids.append(tok.convert_tokens_to_ids(t))
    return list(dict.fromkeys(i for i in ids if i is not None))


def _Streamer(tok, stream):
    from transformers import TextStreamer

    class S(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            stream.write(text)
            stream.flush()

    return S(tok, skip_prompt=True, skip_special_tokens=True)


def _text(s: str) -> str:
    """Text a tokenizer can encode: a non-UTF-8 byte of the terminal or argv (a lone surrogate here) becomes U+FFFD."""
    return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in s)


def repl(model, tok, args) -> None:
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("shardwise chat: type a message; /reset forgets the conversation, /exit or Ctrl-D leaves.",
          file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": _text(line)})
        try:
            reply = answer(model, tok, history, args.max_new_tokens, args.temperature, args.top_p, sys.stdout,
                           args.where)
        except KeyboardInterrupt:  # stops this answer, not the session
            history.pop()
            print("\n(interrupted)", file=sys.stderr)
            continue
        except ShardwiseError as e:  # the template refuses this conversation: say so, keep the session
            history.pop()
            print(f"shardwise: {e}", file=sys.stderr, flush=True)
            continue
        print(flush=True)
        history.append({"role": "assistant", "content": reply})


def run(args) -> int:
    args.system = _text(args.system)
    args.prompt = _text(args.prompt) if args.prompt is not None else None
    if args.max_new_tokens < 1:
        raise ShardwiseError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ShardwiseError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:  # transformers raises a traceback below 0 and ignores it above 1
        raise ShardwiseError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 2**63:
        raise ShardwiseError(f"--seed must be in [0, 2^63), got {args.seed}")
    model_dir, adapter_dir = resolve_dirs(args.dir, args.adapter, args.base)
    from shardwise.rundir import quiet_libraries

    quiet_libraries()
    import torch

    device = _device(args.device)
    torch.manual_seed(args.seed)
    if args.base and adapter_dir:
        model_what = f"--base {model_dir}"
    elif adapter_dir and not args.adapter:
        model_what = f"the base model {model_dir} (recorded in {adapter_dir}/{ADAPTER_CONFIG})"
    else:
        model_what = f"chat {model_dir}"
    adapter_what = f"--adapter {adapter_dir}" if args.adapter else f"chat {adapter_dir}"
    model, tok = load(model_dir, adapter_dir, device, args.trust_remote_code, model_what, adapter_what)
    args.where = adapter_dir or model_dir
    set_template(tok, args.chat_template, args.where)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt if args.prompt is not None else "hi"}]
    check_prompt_ids(model, tok, render(tok, messages, args.where)["input_ids"], args.where)  # before the banner
    what = f"{model_dir} + adapter {adapter_dir}" if adapter_dir else model_dir
    print(f"shardwise chat: {what} on {model.device}", file=sys.stderr, flush=True)
    if args.prompt is not None:
        answer(model, tok, messages, args.max_new_tokens, args.temperature, args.top_p, sys.stdout, args.where)
        print(flush=True)
        return 0
    repl(model, tok, args)
    return 0
