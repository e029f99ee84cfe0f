"""Records -> token ids and next-token targets (labels already shifted, -100 = no loss).

Chat records are rendered with the tokenizer's chat template; only the assistant turns
(content and the template's end-of-turn marker) carry loss. The assistant spans are found
by rendering growing prefixes of the conversation, so any template that renders a prefix
of a conversation as a prefix of the whole works, with no special template markers.
Targets are shifted here, so packing can concatenate examples without a label leaking
across an example boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwise.data.formats import Record
from shardwise.errors import ShardwiseError

IGNORE = -100


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


def assistant_spans(tokenizer, messages: list[dict], source: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans that carry loss."""
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True)) if i else 0
        end_text = render(messages[: i + 1], False)
        if not full.startswith(end_text) or start > len(end_text):
            raise ShardwiseError(f"{source}: the chat template does not render a conversation prefix as a prefix "
                                 "of the whole, so assistant turns cannot be located; use text-format data")
        spans.append((start, len(end_text)))
    return full, spans


def encode_record(tokenizer, rec: Record) -> tuple[list[int], list[int]]:
    """(input_ids, loss mask per token) for one record, untruncated."""
    if rec.kind == "text":
        ids = tokenizer(rec.payload, add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = ids + [tokenizer.eos_token_id]
        return ids, [1] * len(ids)
    text, spans = assistant_spans(tokenizer, rec.payload, rec.source)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = []
    for s, e in offsets:
        mask.append(int(any(a <= s < b for a, b in spans) and e > s))
    return ids, mask


def shift(ids: list[int], mask: list[int]) -> list[int]:
    """Next-token targets: targets[i] = ids[i+1] where that token carries loss."""
    return [ids[i + 1] if mask[i + 1] else IGNORE for i in range(len(ids) - 1)] + [IGNORE]


def encode(records: list[Record], tokenizer, seq_len: int, packing: bool) -> Encoded:
    if any(r.kind == "chat" for r in records) and not getattr(tokenizer, "chat_template", None):
        raise ShardwiseError("the tokenizer has no chat template but the data is chat (messages/alpaca); "
                             "use a model whose tokenizer has one, or text-format data")
    rows_in, rows_tg, sources = [], [], []
    truncated = dropped = 0
    for rec in records:
        ids, mask = encode_record(tokenizer, rec)
        # +1 so the last kept input still has its next token as a target
        if len(ids) > seq_len + 1:
            truncated += 1
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
        tg = shift(ids, mask)[:seq_len]
        ids = ids[:seq_len]
        if not any(t != IGNORE for t in tg):
            dropped += 1
            continue
        rows_in.append(ids)
        rows_tg.append(tg)
        sources.append(rec.source)
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
