import pytest
import torch

from shardwise.data.encode import IGNORE, encode, shift
from shardwise.data.formats import Record
from shardwise.errors import ShardwiseError


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from shardwise.models.load import load_tokenizer

    return load_tokenizer(tiny_dir)


def chat(*turns):
    return Record("chat", [{"role": r, "content": c} for r, c in turns], "t:1")


def decoded_targets(tok, enc, row=0):
    return tok.decode([t for t in enc.targets[row] if t != IGNORE])


def test_loss_only_on_assistant_turns_and_their_end_marker(tok):
    rec = chat(("system", "be brief"), ("user", "reverse: a b"), ("assistant", "b a"),
               ("user", "again"), ("assistant", "a b"))
    enc = encode([rec], tok, 256, packing=False)
    assert decoded_targets(tok, enc) == "b a<|im_end|>\na b<|im_end|>\n"
    # every input position whose target is set is followed by an assistant token
    ids, tg = enc.input_ids[0], enc.targets[0]
    assert all(tg[i] == ids[i + 1] for i in range(len(ids) - 1) if tg[i] != IGNORE)
    assert tg[-1] == IGNORE


def test_text_records_train_on_every_token(tok):
    enc = encode([Record("text", "hello world", "t:1")], tok, 256, packing=False)
    n = len(enc.input_ids[0])
    assert sum(t != IGNORE for t in enc.targets[0]) == n - 1
    assert enc.input_ids[0][-1] == tok.eos_token_id


def test_truncation_is_counted_and_keeps_next_token_target(tok):
    long = chat(("user", "x"), ("assistant", "apple river stone " * 30))
    enc = encode([long, chat(("user", "y"), ("assistant", "z"))], tok, 16, packing=False)
    assert enc.stats["truncated"] == 1 and len(enc.input_ids[0]) == 16 and len(enc.targets[0]) == 16


def test_examples_without_loss_tokens_after_truncation_are_dropped(tok):
    rec = chat(("user", "apple river stone " * 30), ("assistant", "z"))
    with pytest.raises(ShardwiseError, match="no example keeps a loss token at seq_len 16"):
        encode([rec], tok, 16, packing=False)


def test_chat_data_needs_a_chat_template(tok):
    tok2 = type(tok).from_pretrained(tok.name_or_path)
    tok2.chat_template = None
    with pytest.raises(ShardwiseError, match="tokenizer has no chat template"):
        encode([chat(("user", "a"), ("assistant", "b"))], tok2, 64, packing=False)


def test_packing_restarts_positions_and_never_crosses_examples(tok):
    recs = [chat(("user", f"q{i}"), ("assistant", "answer " * (1 + i))) for i in range(6)]
    plain = encode(recs, tok, 64, packing=False)
    packed = encode(recs, tok, 64, packing=True)
    assert len(packed) < len(plain)
    assert sum(len(r) for r in packed.input_ids) == sum(len(r) for r in plain.input_ids)
    assert max(len(r) for r in packed.input_ids) <= 64
    # the concatenated targets are exactly the per-example targets: no label crosses a boundary
    flat = lambda rows: [t for r in rows for t in r]  # noqa: E731
    assert flat(packed.targets) == flat(plain.targets)
    for pos in packed.position_ids:
        starts = [i for i, p in enumerate(pos) if p == 0]
        assert starts[0] == 0 and len(starts) >= 1


def test_packed_attention_is_block_diagonal_in_the_real_model(tok, tiny_dir):
    """A packed row gives each example the same logits as running it alone."""
    from shardwise.models.load import load_model

    model = load_model(tiny_dir, torch.float32).eval()
    recs = [chat(("user", "reverse: a b c"), ("assistant", "c b a")), chat(("user", "sort 3 1"), ("assistant", "1 3"))]
    plain = encode(recs, tok, 128, packing=False)
    packed = encode(recs, tok, 128, packing=True)
    assert len(packed) == 1
    with torch.no_grad():
        row = torch.tensor([packed.input_ids[0]])
        pos = torch.tensor([packed.position_ids[0]])
        together = model(input_ids=row, position_ids=pos).logits[0]
        n0 = len(plain.input_ids[0])
        alone = model(input_ids=torch.tensor([plain.input_ids[1]])).logits[0]
        torch.testing.assert_close(together[n0:], alone, rtol=1e-4, atol=1e-4)
        # without restarting positions the second example would see the first
        leaky = model(input_ids=row).logits[0]
        assert (leaky[n0:] - alone).abs().max() > 1e-2


def test_shift_masks_targets_not_followed_by_loss_tokens():
    assert shift([1, 2, 3, 4], [0, 0, 1, 1]) == [IGNORE, 3, 4, IGNORE]


def test_batched_encoding_gives_the_per_record_tokens(tok):
    """encode() renders each conversation's last turn once and tokenizes records in batches;
    the tokens and loss masks must be those of encoding every record on its own (text and
    chat mixed, across a chunk boundary, multi-turn, cut records)."""
    from shardwise.data.encode import ChatOptions, encode_record, encode_records

    recs = [chat(("user", f"q{i} " * (i % 5 + 1)), ("assistant", f"a{i} " * (i % 7 + 1)),
                 *((("user", "more"), ("assistant", "yes")) if i % 3 == 0 else ()))
            for i in range(7)]
    recs[2:2] = [Record("text", "plain text record", "t:2"), Record("text", "x" * 500, "t:3")]
    for opts in (ChatOptions(), ChatOptions(system="sys", last_turn_only=True), ChatOptions(train_on_prompt=True)):
        one_by_one = [encode_record(tok, r, opts, 120) for r in recs]
        assert list(encode_records(tok, recs, opts, 120, chunk=3)) == one_by_one
        assert any(cut for _, _, cut in one_by_one)
        assert any(0 < sum(m) < len(m) for _, m, _ in one_by_one) or opts.train_on_prompt


def test_span_mask_matches_the_per_token_definition_on_random_offsets_and_spans():
    """data/encode.span_mask (bisection over merged spans) gives, token for token, what its definition says:
    int(e > s and any(a <= s < b for a, b in spans)), with spans unsorted, overlapping, touching or empty and
    offsets empty, repeated or out of order (special tokens, byte fallback)."""
    import random

    from shardwise.data.encode import span_mask

    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(0, 60)
        offsets = []
        for _ in range(rng.randint(0, 40)):
            s = rng.randint(0, n)
            offsets.append((s, s + rng.choice([0, 0, 1, 2, 3])))
        if rng.random() < 0.7:
            offsets.sort()
        spans = []
        for _ in range(rng.randint(0, 5)):
            a = rng.randint(0, n)
            spans.append((a, a + rng.randint(-2, 12)))
        want = [int(e > s and any(a <= s < b for a, b in spans)) for s, e in offsets]
        assert span_mask(offsets, spans) == want, (offsets, spans)


def test_rust_threads_turn_the_tokenizer_pool_on_only_around_a_batch_and_only_where_shardwise_turned_it_off(
        monkeypatch):
    """data/encode.rust_threads: TOKENIZERS_PARALLELISM is true inside (a fast tokenizer's batch on all cores) and
    false again after, so a process forked later finds it set; a value the user set is never touched."""
    import os

    from shardwise.data.encode import rust_threads
    from shardwise.rundir import quiet_libraries

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.delenv("SHARDWISE_TOKENIZERS_PARALLELISM_OURS", raising=False)
    quiet_libraries(transformers=False)  # what every shardwise process does first: off, and marked as ours
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    with rust_threads():
        assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    with pytest.raises(RuntimeError):
        with rust_threads():
            raise RuntimeError("a batch failed")
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"  # back off after an error too

    for users in ("false", "true", "0"):  # the user's own setting, before shardwise started
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", users)
        monkeypatch.delenv("SHARDWISE_TOKENIZERS_PARALLELISM_OURS", raising=False)
        quiet_libraries(transformers=False)
        with rust_threads():
            assert os.environ["TOKENIZERS_PARALLELISM"] == users
        assert os.environ["TOKENIZERS_PARALLELISM"] == users


def test_the_tokenizer_pool_changes_no_token(tok, monkeypatch):
    """The same records encode to the same tensors with the tokenizer's thread pool on around the batches (a
    shardwise process) and off (the user's TOKENIZERS_PARALLELISM=false)."""
    import random

    rng = random.Random(1)
    words = "the a cat sat on mat reverse sort these words again please ok".split()
    recs = [chat(("user", " ".join(rng.choices(words, k=rng.randint(1, 20)))),
                 ("assistant", " ".join(rng.choices(words, k=rng.randint(1, 30))))) for _ in range(300)]
    recs += [Record("text", " ".join(rng.choices(words, k=rng.randint(1, 40))), "t:2") for _ in range(100)]
    results = []
    for ours in ("1", ""):
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
        monkeypatch.setenv("SHARDWISE_TOKENIZERS_PARALLELISM_OURS", ours)
        results.append(encode(recs, tok, 64, packing=True))
    on, off = results
    for name in ("input_ids", "targets"):
        assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b))
                   for a, b in zip(getattr(on, name), getattr(off, name), strict=True))
