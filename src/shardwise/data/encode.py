"""Records -> token ids and next-token targets (labels already shifted, -100 = no loss).

Chat records are rendered with the tokenizer's chat template (or the one --chat-template
names); by default the assistant turns (content and the template's end-of-turn marker)
carry loss, with --last-turn-only only the last assistant turn, with --train-on-prompt
every token of the conversation. The turn spans are found by rendering growing prefixes of
the conversation, so any template that renders a prefix of a conversation as a prefix of
the whole works, with no special template markers. Targets are shifted here, so packing
can concatenate examples without a label leaking across an example boundary.

Memory per record is bounded before tokenizing: a record's text (its tool schemas and
tool calls as JSON included) beyond (seq_len + 1) * CHARS_PER_TOKEN_BOUND characters is
cut (and the record counted as truncated), since it could not fit in seq_len tokens anyway: no tokenizer we know averages
more than about 10 characters per token over a span, and 32 leaves room to spare.
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from shardwise.data.formats import Record
from shardwise.errors import ShardwiseError

IGNORE = -100
CHARS_PER_TOKEN_BOUND = 32


@dataclass
class ChatOptions:
    """How chat records become examples (config keys system, train_on_prompt, last_turn_only)."""

    system: str = ""  # default system prompt for conversations without one
    train_on_prompt: bool = False  # loss on every token, the user and system turns too
    last_turn_only: bool = False  # loss on the last assistant turn only

    @classmethod
    def from_config(cls, cfg) -> "ChatOptions":
        return cls(cfg.system, cfg.train_on_prompt, cfg.last_turn_only)


@dataclass
class Encoded:
    """A tokenized dataset: one row per training sequence (an example, or a pack of them)."""

    input_ids: list[list[int]]
    targets: list[list[int]]
    position_ids: list[list[int]]
    sources: list[str]  # first record of each row, "file:line"
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_ids)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        lens = torch.tensor([len(x) for x in self.input_ids], dtype=torch.int64)
        flat = lambda rows: torch.tensor([t for r in rows for t in r], dtype=torch.int32)  # noqa: E731
        return {"input_ids": flat(self.input_ids), "targets": flat(self.targets),
                "position_ids": flat(self.position_ids), "lengths": lens}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "Encoded":
        lens = t["lengths"].tolist()
        split = lambda x: [r.tolist() for r in torch.split(x.to(torch.int64), lens)]  # noqa: E731
        return cls(split(t["input_ids"]), split(t["targets"]), split(t["position_ids"]), [""] * len(lens))


def _render(tokenizer, msgs: list[dict], gen: bool, source: str, tools: list | None = None) -> str:
    # `tools` only when the record has some: a template sees no `tools` variable otherwise, as before
    kw = {"tools": tools} if tools else {}
    try:  # the template's syntax was checked where it was chosen (data/templates.use_chat_template)
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)
    except Exception as e:  # jinja raises TemplateError / TypeError / ...; templates raise their own
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ShardwiseError(f"{source}: the chat template cannot render this conversation ({detail}); fix the "
                             "record or choose another template with --chat-template") from None


def assistant_spans(tokenizer, messages: list[dict], source: str, turns: list[int] | None = None,
                    tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans that carry loss: those of the
    assistant turns `turns` (default: every assistant turn), their tool calls included; tool
    results are not assistant turns, so they carry none."""
    full = _render(tokenizer, messages, False, source, tools)
    if turns is None:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans = []
    for i in turns:
        start = len(_render(tokenizer, messages[:i], True, source, tools)) if i else 0
        # the conversation's last turn ends where the whole does: no second render of it
        end_text = full if i + 1 == len(messages) else _render(tokenizer, messages[: i + 1], False, source, tools)
        if not full.startswith(end_text) or start > len(end_text):
            raise ShardwiseError(f"{source}: the chat template does not render a conversation prefix as a prefix "
                                 "of the whole, so assistant turns cannot be located; use text-format data or "
                                 "another --chat-template")
        spans.append((start, len(end_text)))
    return full, spans


def _size(x) -> int:
    """Characters of a tool call list or schema as JSON, as templates print them (0 for none)."""
    return len(json.dumps(x, ensure_ascii=False)) if x else 0


def bound_chat(messages: list[dict], opts: ChatOptions, budget: int | None, tools: list | None = None
               ) -> tuple[list[dict], list[int], bool, list | None]:
    """(messages, the assistant turns that carry loss, whether text was cut, the tools): the default
    system prompt added, then the tool schemas, the contents and the tool calls cut to `budget`
    characters in order. The schemas come first, as templates render them before the turns; a
    schema or a call that does not fit whole is left out with all that follows it (half a call
    is not one), and the record counts as cut."""
    msgs = list(messages)
    if opts.system and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": opts.system})
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if opts.last_turn_only:
        turns = turns[-1:]
    cut = False
    if budget is not None and _size(tools) + sum(len(m["content"]) + _size(m.get("tool_calls")) for m in msgs) > budget:
        kept_tools, used = [], 0
        for t in tools or []:
            if used + _size(t) > budget:
                break
            kept_tools.append(t)
            used += _size(t)
        tools = kept_tools or None
        kept = []
        for m in msgs:
            calls = _size(m.get("tool_calls"))
            if used >= budget or used + calls > budget:
                break
            c = m["content"][: budget - used - calls]
            kept.append({**m, "content": c})  # a tool call or a tool result's id stays with its turn
            used += len(c) + calls
        msgs, cut = kept, True
        turns = [i for i in turns if i < len(msgs)]
    return msgs, turns, cut, tools


def render_record(tokenizer, rec: Record, opts: ChatOptions | None = None, budget: int | None = None
                  ) -> tuple[str, list[tuple[int, int]] | None, bool]:
    """(text, character spans that carry loss or None for all of it, whether the text was
    cut to `budget` characters) for one record: the chat template rendered, nothing tokenized."""
    opts = opts or ChatOptions()
    if rec.kind == "text":
        text, cut = rec.payload, False
        if budget is not None and len(text) > budget:
            text, cut = text[:budget], True
        return text, None, cut
    msgs, turns, cut, tools = bound_chat(rec.payload, opts, budget, rec.tools)
    if opts.train_on_prompt:
        return _render(tokenizer, msgs, False, rec.source, tools), None, cut
    text, spans = assistant_spans(tokenizer, msgs, rec.source, turns, tools)
    return text, spans, cut


def _ids_and_mask(tokenizer, rec: Record, enc_ids: list[int], offsets, spans, cut: bool) -> tuple[list[int], list[int]]:
    if rec.kind == "text":
        ids = enc_ids
        if not cut and tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = ids + [tokenizer.eos_token_id]
        return ids, [1] * len(ids)
    if spans is None:
        return enc_ids, [1] * len(enc_ids)
    return enc_ids, span_mask(offsets, spans)


def span_mask(offsets, spans) -> list[int]:
    """1 for each token (its character offsets (s, e)) that is not empty and starts inside one of `spans`
    (character ranges [a, b)), else 0: `int(e > s and any(a <= s < b for a, b in spans))` per token. The spans are
    merged into sorted disjoint ranges (their union, so the same starts fall inside) and each token is looked up by
    bisection: a third of a first run's tokenizing was that expression's generator, per token and span."""
    starts: list[int] = []
    ends: list[int] = []
    for a, b in sorted(sp for sp in spans if sp[1] > sp[0]):
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    if not starts:
        return [0] * len(offsets)
    out = []
    for s, e in offsets:
        i = bisect_right(starts, s) - 1
        out.append(1 if e > s and i >= 0 and s < ends[i] else 0)
    return out


def _tokenize(tokenizer, rec: Record, text: str):
    """(ids, offsets) of one rendered record: text records with the tokenizer's special
    tokens, chat records without (the template wrote them)."""
    if rec.kind == "text":
        return tokenizer(text, add_special_tokens=True)["input_ids"], None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], enc["offset_mapping"]


def encode_record(tokenizer, rec: Record, opts: ChatOptions | None = None,
                  budget: int | None = None) -> tuple[list[int], list[int], bool]:
    """(input_ids, loss mask per token, whether the text was cut to `budget` characters)
    for one record, not yet truncated to seq_len."""
    text, spans, cut = render_record(tokenizer, rec, opts, budget)
    ids, offsets = _tokenize(tokenizer, rec, text)
    return (*_ids_and_mask(tokenizer, rec, ids, offsets, spans, cut), cut)


@contextmanager
def rust_threads():
    """A fast tokenizer's batch on all cores (its Rust thread pool): 25-35% less time per batch of chat records on
    this 2-core box, more with more cores. shardwise sets TOKENIZERS_PARALLELISM=false for its processes (rundir.
    quiet_libraries: the tokenizers library warns in every process forked after its pool ran); around a batch it is
    true, then false again, so a process forked later finds it set (no warning, no pool in the child). A value the
    user set is left alone."""
    if os.environ.get("SHARDWISE_TOKENIZERS_PARALLELISM_OURS") != "1" or \
            os.environ.get("TOKENIZERS_PARALLELISM") != "false":
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"


def encode_records(tokenizer, records: list[Record], opts: ChatOptions | None, budget: int | None,
                   chunk: int = 1024) -> Iterator[tuple[list[int], list[int], bool]]:
    """encode_record over `records`, in order, the same tokens: the rendered texts of up to
    `chunk` records go to the tokenizer in one batched call (a fast tokenizer's batch runs
    in Rust; one call per record spends most of its time in Python)."""
    for lo in range(0, len(records), chunk):
        part = records[lo: lo + chunk]
        rendered = [render_record(tokenizer, r, opts, budget) for r in part]
        by_kind: dict[str, list[int]] = {"text": [], "chat": []}
        for j, r in enumerate(part):
            by_kind["text" if r.kind == "text" else "chat"].append(j)
        toks: list = [None] * len(part)
        if by_kind["text"]:
            with rust_threads():
                out = tokenizer([rendered[j][0] for j in by_kind["text"]], add_special_tokens=True)["input_ids"]
            for j, ids in zip(by_kind["text"], out):
                toks[j] = (ids, None)
        if by_kind["chat"]:
            with rust_threads():
                out = tokenizer([rendered[j][0] for j in by_kind["chat"]], add_special_tokens=False,
                                return_offsets_mapping=True)
            for j, ids, offs in zip(by_kind["chat"], out["input_ids"], out["offset_mapping"]):
                toks[j] = (ids, offs)
        for r, (text, spans, cut), (ids, offs) in zip(part, rendered, toks):
            yield (*_ids_and_mask(tokenizer, r, ids, offs, spans, cut), cut)


def shift(ids: list[int], mask: list[int]) -> list[int]:
    """Next-token targets: targets[i] = ids[i+1] where that token carries loss."""
    return [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])] + [IGNORE]


def check_options(tokenizer, options: ChatOptions | None, chat: bool) -> None:
    """Refuse chat data without a chat template, and contradicting options."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ShardwiseError("the tokenizer has no chat template but the data is chat (messages/sharegpt/alpaca); "
                             "pass --chat-template NAME (chatml, llama3, qwen, mistral, gemma) or a Jinja FILE, "
                             "or use text-format data")
    if options and options.train_on_prompt and options.last_turn_only:
        raise ShardwiseError("--train-on-prompt (loss on every turn) and --last-turn-only (loss on the last "
                             "assistant turn) contradict each other; pass one of them")


# A conversation with every tool part, each named so that its name shows whether the template rendered it; the call's
# id is 9 letters and digits, the form Mistral's own templates insist on.
PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_tool_schema", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}]
PROBE = [{"role": "user", "content": "u"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "id": "probe0001",
              "function": {"name": "probe_tool_call", "arguments": {"probe_argument": 1}}}]},
         {"role": "tool", "tool_call_id": "probe0001", "content": "probe_tool_result"},
         {"role": "assistant", "content": "a"}]


def template_name(tokenizer) -> str:
    """How the error lines name the chat template in effect (data/templates.use_chat_template records it)."""
    value = getattr(tokenizer, "shardwise_template", "")
    from shardwise.data.templates import names

    if not value:
        return "the model's own chat template"
    return f"the chat template '{value}'" if value in names() else f"the chat template {value}"


def check_tools(tokenizer, records: list[Record]) -> None:
    """Refuse tool-call data whose template would drop a part of it (the schemas, the calls, their arguments or
    the results) or cannot render it, naming the first such record: a template that ignores `tools` or
    `tool_calls` renders a conversation that teaches the model to answer without them."""
    rec = next((r for r in records if r.has_tools), None)
    if rec is None:
        return
    try:
        text = tokenizer.apply_chat_template(PROBE, tools=PROBE_TOOLS, tokenize=False)
        lost = [what for what, mark in (("tools", "probe_tool_schema"), ("tool calls", "probe_tool_call"),
                                        ("their arguments", "probe_argument"), ("tool results", "probe_tool_result"))
                if mark not in text]
        why = f"drops {', '.join(lost)}" if lost else ""
    except Exception as e:  # jinja's errors, and raise_exception in templates with no tool format
        why = "cannot render them (" + (str(e).strip().splitlines() or [type(e).__name__])[0][:160] + ")"
    if why:
        raise ShardwiseError(f"{rec.source}: this record has tool calls, but {template_name(tokenizer)} {why}; "
                             "pass --chat-template chatml, qwen, llama3 or mistral (they render tools and tool "
                             "calls), or a template of your own that renders `tools` and `tool_calls`")


def _beyond_vocab(tokenizer, vocab: int, who: str, what: str) -> ShardwiseError:
    """The line for a token id the model cannot embed (`what`: which id, where)."""
    top = max(tokenizer.get_vocab().values(), default=-1)
    return ShardwiseError(f"{who}: {what} but config.json vocab_size is {vocab} (the model embeds ids 0-{vocab - 1}); "
                          f"the tokenizer ({len(tokenizer)} tokens, ids up to {top}) is not this model's: copy its "
                          "tokenizer files from the model the weights come from (or, if tokens were added to it, "
                          "resize the model's embeddings to match)")


def check_pad_id(tokenizer) -> None:
    """Padding puts the pad token's id in the batches' inputs: it must be one the model can embed (the vocab size
    load_tokenizer attached as `shardwise_vocab`; no check without one)."""
    vocab, who = getattr(tokenizer, "shardwise_vocab", (None, ""))
    pad = tokenizer.pad_token_id
    if vocab is not None and pad is not None and pad >= vocab:
        eos = tokenizer.eos_token_id
        hint = f" (e.g. its eos token {tokenizer.eos_token!r})" if eos is not None and eos < vocab else ""
        raise ShardwiseError(f"{who}: its pad token {tokenizer.pad_token!r} has id {pad} but config.json vocab_size "
                             f"is {vocab}: padding would index past the model's embedding; set pad_token in "
                             f"tokenizer_config.json to a token below {vocab}{hint}")


PROGRESS_EVERY = 256  # records between two calls of encode's progress


def encode(records: list[Record], tokenizer, seq_len: int, packing: bool,
           options: ChatOptions | None = None, progress=None) -> Encoded:
    """Records -> Encoded rows. A token id the model cannot embed (at or above config.json's vocab_size, which
    load_tokenizer attached to the tokenizer) is refused here, naming the record, before anything is written: the
    ids the data holds, not the tokenizer's size, since a real tokenizer may list ids past the embedding that text
    never produces (transformers' Qwen2 tokenizer adds <|endoftext|> at id vocab_size to a 512-token model)."""
    check_options(tokenizer, options, any(r.kind in ("chat", "pair") for r in records))
    check_tools(tokenizer, records)
    check_pad_id(tokenizer)
    if records and records[0].kind == "pair":  # task dpo: chosen and rejected rows
        return encode_pairs(records, tokenizer, seq_len, options.system if options else "")
    vocab, who = getattr(tokenizer, "shardwise_vocab", (None, ""))
    budget = (seq_len + 1) * CHARS_PER_TOKEN_BOUND
    rows_in, rows_tg, sources = [], [], []
    truncated = dropped = nevers = 0
    never = ""  # the first record with no loss token even whole (not a seq_len matter)
    for i, (rec, (ids, mask, cut)) in enumerate(zip(records, encode_records(tokenizer, records, options, budget))):
        if progress is not None and i and i % PROGRESS_EVERY == 0:  # progress(records done): the launcher's count
            progress(i)
        whole = not cut and not any(mask[1:])
        # +1 so the last kept input still has its next token as a target
        if cut or len(ids) > seq_len + 1:
            truncated += 1
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
        tg = shift(ids, mask)[:seq_len]
        if vocab is not None and ids and max(ids) >= vocab:  # an input (or the last input's target) it cannot embed
            raise _beyond_vocab(tokenizer, vocab, who, f"its tokenizer gives token id {max(ids)} in {rec.source}")
        ids = ids[:seq_len]
        if not any(t != IGNORE for t in tg):
            dropped += 1
            nevers += whole
            never = never or (rec.source if whole else "")
            continue
        rows_in.append(ids)
        rows_tg.append(tg)
        sources.append(rec.source)
    if not rows_in and nevers == dropped:
        raise ShardwiseError(f"{never}: no token of this example carries loss even untruncated, nor of any other "
                             f"({dropped} dropped): the chat template renders no assistant text; check it "
                             "(--chat-template) or use text-format data")
    if not rows_in:
        raise ShardwiseError(f"no example keeps a loss token at seq_len {seq_len} ({dropped} dropped); raise --seq-len")
    stats = {"records": len(records), "truncated": truncated, "dropped_no_loss_tokens": dropped,
             "loss_tokens": sum(sum(t != IGNORE for t in tg) for tg in rows_tg),
             "tokens": sum(len(r) for r in rows_in)}
    if packing:
        out = pack(rows_in, rows_tg, sources, seq_len)
    else:
        out = Encoded(rows_in, rows_tg, [list(range(len(r))) for r in rows_in], sources)
    stats["sequences"] = len(out)
    out.stats = stats
    return out


def pack(rows_in, rows_tg, sources, seq_len: int) -> Encoded:
    """Greedy, in order: fill each sequence with whole examples up to seq_len.

    Positions restart at 0 for every example; the model builds a block-diagonal causal mask
    from them (transformers detects packed position_ids), so no token attends across an
    example boundary, and targets were shifted per example, so no loss crosses it either.
    """
    out_in, out_tg, out_pos, out_src = [], [], [], []
    cur_in, cur_tg, cur_pos, cur_src = [], [], [], None
    for ids, tg, src in zip(rows_in, rows_tg, sources):
        if cur_in and len(cur_in) + len(ids) > seq_len:
            out_in.append(cur_in), out_tg.append(cur_tg), out_pos.append(cur_pos), out_src.append(cur_src)
            cur_in, cur_tg, cur_pos, cur_src = [], [], [], None
        cur_in += ids
        cur_tg += tg
        cur_pos += list(range(len(ids)))
        cur_src = cur_src or src
    if cur_in:
        out_in.append(cur_in), out_tg.append(cur_tg), out_pos.append(cur_pos), out_src.append(cur_src)
    return Encoded(out_in, out_tg, out_pos, out_src)


# -- preference pairs (task dpo; the records: data/preference.py) ------------------------------------------------


def pair_texts(tokenizer, rec: Record, system: str = "") -> tuple[str, str, str]:
    """(prompt text with the generation prompt, chosen answer text, rejected answer text): each answer is the rest of
    its rendered conversation after the prompt's text."""
    prompt = list(rec.payload)
    if system and prompt[0]["role"] != "system":
        prompt.insert(0, {"role": "system", "content": system})
    head = _render(tokenizer, prompt, True, rec.source, rec.tools)
    out = [head]
    for answer in (rec.chosen, rec.rejected):
        full = _render(tokenizer, prompt + [answer], False, rec.source, rec.tools)
        if not full.startswith(head) or len(full) == len(head):
            raise ShardwiseError(f"{rec.source}: the chat template does not render the prompt (with its generation "
                                 "prompt) as a prefix of the answered conversation, so the answer cannot be located; "
                                 "use another --chat-template")
        out.append(full[len(head):])
    return out[0], out[1], out[2]


def encode_pairs(records: list[Record], tokenizer, seq_len: int, system: str = ""):
    """Preference records -> Encoded rows, chosen and rejected interleaved (row 2i, 2i + 1). A row longer than
    seq_len keeps its start (the prompt, then as much of the answer as fits); a pair either of whose answers keeps no
    token is dropped (counted)."""
    rows_in, rows_tg, sources = [], [], []
    truncated = dropped = 0
    vocab, who = getattr(tokenizer, "shardwise_vocab", (None, ""))
    texts = [pair_texts(tokenizer, r, system) for r in records]
    for lo in range(0, len(texts), 1024):
        part = texts[lo: lo + 1024]
        flat = [t for trio in part for t in trio]
        ids = tokenizer(flat, add_special_tokens=False)["input_ids"]
        for j, rec in enumerate(records[lo: lo + 1024]):
            p, a_c, a_r = ids[3 * j: 3 * j + 3]
            pair = []
            for a in (a_c, a_r):
                row, mask = p + a, [0] * len(p) + [1] * len(a)
                if len(row) > seq_len + 1:
                    truncated += 1
                    row, mask = row[: seq_len + 1], mask[: seq_len + 1]
                tg = shift(row, mask)[:seq_len]
                if vocab is not None and row and max(row) >= vocab:
                    raise _beyond_vocab(tokenizer, vocab, who, f"its tokenizer gives token id {max(row)} in "
                                        f"{rec.source}")
                pair.append((row[:seq_len], tg))
            if any(all(t == IGNORE for t in tg) for _, tg in pair):
                dropped += 1
                continue
            for row, tg in pair:
                rows_in.append(row)
                rows_tg.append(tg)
                sources.append(rec.source)
    if not rows_in:
        raise ShardwiseError(f"no preference pair keeps an answer token at seq_len {seq_len} ({dropped} dropped: "
                             "their prompts fill it); raise --seq-len")
    out = Encoded(rows_in, rows_tg, [list(range(len(r))) for r in rows_in], sources)
    out.stats = {"records": len(records), "truncated": truncated, "dropped_no_loss_tokens": dropped,
                 "loss_tokens": sum(sum(t != IGNORE for t in tg) for tg in rows_tg),
                 "tokens": sum(len(r) for r in rows_in), "sequences": len(rows_in), "pairs": len(rows_in) // 2}
    return out
