"""Shipped chat templates, loss masking options, the default system prompt, the bound per record."""

import pytest

from shardwise.data.encode import CHARS_PER_TOKEN_BOUND, IGNORE, ChatOptions, encode
from shardwise.data.formats import Record
from shardwise.data.templates import names, template_text, use_chat_template
from shardwise.errors import ShardwiseError

CONV = [("system", "be brief"), ("user", "reverse: a b"), ("assistant", "b a"), ("user", "again"), ("assistant", "a b")]


@pytest.fixture()
def tok(tiny_dir):
    from shardwise.models.load import load_tokenizer

    return load_tokenizer(tiny_dir)


def chat(*turns):
    return Record("chat", [{"role": r, "content": c} for r, c in turns], "t:1")


def loss_text(tok, enc, row=0):
    return tok.decode([t for t in enc.targets[row] if t != IGNORE])


def test_shipped_templates_are_listed():
    assert {"chatml", "llama3", "qwen", "mistral", "gemma"} <= set(names())


@pytest.mark.parametrize("name, rendered, loss", [
    ("chatml", ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nreverse: a b<|im_end|>\n"
                "<|im_start|>assistant\nb a<|im_end|>\n"), "b a<|im_end|>\n"),
    ("qwen", ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nreverse: a b<|im_end|>\n"
              "<|im_start|>assistant\nb a<|im_end|>\n"), "b a<|im_end|>\n"),
    ("llama3", ("<|bos|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|><|start_header_id|>user"
                "<|end_header_id|>\n\nreverse: a b<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nb a"
                "<|eot_id|>"), "b a<|eot_id|>"),
    ("mistral", "<|bos|>[INST] be brief\n\nreverse: a b [/INST]b a<|eos|>", "b a<|eos|>"),
    ("gemma", ("<|bos|><start_of_turn>user\nbe brief\n\nreverse: a b<end_of_turn>\n<start_of_turn>model\nb a"
               "<end_of_turn>\n"), "b a<end_of_turn>\n"),
])
def test_each_template_renders_and_masks(tok, name, rendered, loss):
    use_chat_template(tok, name)
    turns = CONV[:3] if name != "qwen" else CONV[1:3]
    msgs = [{"role": r, "content": c} for r, c in turns]
    assert tok.apply_chat_template(msgs, tokenize=False) == rendered
    enc = encode([chat(*turns)], tok, 256, packing=False)
    assert loss_text(tok, enc) == loss
    # two assistant turns: both carry loss, the user turns none
    enc = encode([chat(*CONV)], tok, 256, packing=False)
    text = loss_text(tok, enc)
    assert "b a" in text and "a b" in text and "again" not in text and "reverse" not in text


def test_template_from_a_file_and_unknown_names(tok, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
    use_chat_template(tok, str(f))
    enc = encode([chat(("user", "q"), ("assistant", "answer"))], tok, 64, packing=False)
    assert loss_text(tok, enc) == "answer\n"
    with pytest.raises(ShardwiseError, match=r"--chat-template: 'vicuna' is neither a shipped chat template "
                                             r"\(chatml, gemma, llama3, mistral, qwen\) nor a Jinja file"):
        template_text("vicuna")


def test_a_template_that_cannot_render_names_the_record(tok, tmp_path):
    f = tmp_path / "strict.jinja"
    f.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
                 "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    use_chat_template(tok, str(f))
    with pytest.raises(ShardwiseError, match=r"t:1: the chat template cannot render this conversation "
                                             r"\(no system role here\)"):
        encode([chat(*CONV)], tok, 64, packing=False)


def test_train_on_prompt_and_last_turn_only(tok):
    enc = encode([chat(*CONV)], tok, 256, packing=False, options=ChatOptions(last_turn_only=True))
    assert loss_text(tok, enc) == "a b<|im_end|>\n"
    enc = encode([chat(*CONV)], tok, 256, packing=False, options=ChatOptions(train_on_prompt=True))
    assert sum(t != IGNORE for t in enc.targets[0]) == len(enc.input_ids[0]) - 1
    assert "reverse: a b" in loss_text(tok, enc) and "be brief" in loss_text(tok, enc)
    with pytest.raises(ShardwiseError, match="contradict each other"):
        encode([chat(*CONV)], tok, 256, packing=False, options=ChatOptions(train_on_prompt=True, last_turn_only=True))


def test_default_system_prompt_only_where_none(tok):
    opts = ChatOptions(system="You are terse.")
    enc = encode([chat(("user", "q"), ("assistant", "a")), chat(*CONV)], tok, 256, packing=False, options=opts)
    assert tok.decode(enc.input_ids[0]).startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert "You are terse." not in tok.decode(enc.input_ids[1])


def test_base_model_without_template_names_the_flag(tok):
    tok.chat_template = None
    with pytest.raises(ShardwiseError, match=r"tokenizer has no chat template.*pass --chat-template NAME"):
        encode([chat(("user", "a"), ("assistant", "b"))], tok, 64, packing=False)
    use_chat_template(tok, "chatml")
    assert len(encode([chat(("user", "a"), ("assistant", "b"))], tok, 64, packing=False)) == 1


class Spy:
    """The tokenizer, recording the longest text it was asked to tokenize (the encoder passes batches: each text of
    a list counts, not the list's length)."""

    def __init__(self, tok):
        self.tok, self.longest, self.calls = tok, 0, 0

    def __call__(self, text, **kw):
        self.calls += 1
        self.longest = max([self.longest] + [len(t) for t in ([text] if isinstance(text, str) else text)])
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_memory_per_record_is_bounded_before_tokenizing(tok):
    seq = 16
    budget = (seq + 1) * CHARS_PER_TOKEN_BOUND
    spy = Spy(tok)
    recs = [Record("text", "apple river " * 200_000, "t:1"),  # 2.4M characters
            chat(("user", "q " * 500_000), ("assistant", "never reached")),
            chat(("user", "short"), ("assistant", "green " * 300_000))]
    enc = encode(recs, spy, seq, packing=False)
    assert spy.calls and spy.longest > budget // 2  # the spy saw the records' texts, not only short markers
    assert spy.longest < budget + 200  # the content budget plus the template's markers
    assert enc.stats["truncated"] == 3 and enc.stats["dropped_no_loss_tokens"] == 1
    assert len(enc.input_ids[0]) == seq
    assert loss_text(tok, enc, 1).startswith("green green")
