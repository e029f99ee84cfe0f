"""Tool-call and agent data (LLaMA-Factory's glaive-style ShareGPT and OpenAI's messages with tool_calls), multi-part
content and preference pairs, through the real readers, the shipped templates and a locally built tokenizer. The
fixtures are written here in the shapes those projects use."""

import json

import pytest

from shardwise.data.cache import records_digest
from shardwise.data.encode import CHARS_PER_TOKEN_BOUND, IGNORE, encode
from shardwise.data.formats import Record
from shardwise.data.sources import read_records
from shardwise.data.templates import use_chat_template
from shardwise.errors import ShardwiseError

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SCHEMA = json.dumps({"type": "function", "function": WEATHER})
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
# LLaMA-Factory's glaive_toolcall shape: a JSON array, `tools` a JSON string of bare schemas, the call's text JSON
GLAIVE = [{"conversations": [{"from": "human", "value": "Weather in Oslo?"},
                             {"from": "function_call", "value": CALL},
                             {"from": "observation", "value": '{"temp": 3}'},
                             {"from": "gpt", "value": "It is 3 degrees."}],
           "system": "Be brief.", "tools": json.dumps([WEATHER])},
          {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}],
           "tools": json.dumps([WEATHER])}]
# OpenAI's shape: arguments a JSON string, the result a `tool` message answering the call's id, `tools` a list
OPENAI = {"messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Weather in Oslo?"},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
                       {"role": "assistant", "content": "It is 3 degrees."}],
          "tools": [{"type": "function", "function": WEATHER}]}


@pytest.fixture()
def tok(tiny_dir):
    from shardwise.models.load import load_tokenizer

    return load_tokenizer(tiny_dir)


@pytest.fixture()
def files(tmp_path):
    glaive = tmp_path / "glaive_toolcall.json"
    glaive.write_text(json.dumps(GLAIVE, indent=2))
    openai = tmp_path / "openai_tools.jsonl"
    openai.write_text(json.dumps(OPENAI) + "\n")
    return str(glaive), str(openai)


def loss_pieces(tok, enc, row=0):
    """The texts of the runs of tokens that carry loss, in order."""
    out, cur = [], []
    for t in enc.targets[row] + [IGNORE]:
        if t != IGNORE:
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out


def test_both_shapes_read_as_the_same_openai_messages_and_keep_their_tools(files):
    (g1, g2), _ = read_records(files[0])
    (o,), _ = read_records(files[1])
    assert g1.payload == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": '{"temp": 3}'}, {"role": "assistant", "content": "It is 3 degrees."}]
    assert g1.tools == g2.tools == o.tools == [{"type": "function", "function": WEATHER}]
    assert o.payload[2]["tool_calls"][0] == {"type": "function", "id": "call_1",
                                             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    assert o.payload[3] == {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1"}
    # the tools are part of what the cached tokens depend on
    assert records_digest([g2]) != records_digest([type(g2)(g2.kind, g2.payload, g2.source)])


HERMES_SYSTEM = ("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call the functions whose JSON signatures are "
                 "listed inside <tools></tools>:\n<tools>\n" + SCHEMA + "\n</tools>\n\nTo call one, reply with a JSON "
                 "object holding its name and arguments inside <tool_call></tool_call>:\n<tool_call>\n{\"name\": "
                 "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
HERMES = (HERMES_SYSTEM + "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n" + CALL
          + "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 3}\n</tool_response><|im_end|>\n"
          "<|im_start|>assistant\nIt is 3 degrees.<|im_end|>\n")
LLAMA3 = ("<|bos|><|start_header_id|>system<|end_header_id|>\n\nBe brief.\n\nYou have access to the functions below. "
          "To call one, respond with a JSON object of the form {\"name\": function name, \"parameters\": dictionary "
          "of argument name and its value}.\n\n" + SCHEMA + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
          "Weather in Oslo?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
          "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}<|eot_id|><|start_header_id|>ipython"
          "<|end_header_id|>\n\n{\"temp\": 3}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
          "It is 3 degrees.<|eot_id|>")
MISTRAL = ("<|bos|>[AVAILABLE_TOOLS] [" + SCHEMA + "][/AVAILABLE_TOOLS][INST] Be brief.\n\nWeather in Oslo? [/INST]"
           "[TOOL_CALLS] [" + CALL + "]<|eos|>[TOOL_RESULTS] {\"content\": \"{\\\"temp\\\": 3}\"}[/TOOL_RESULTS]"
           "It is 3 degrees.<|eos|>")


@pytest.mark.parametrize("name, rendered, loss", [
    ("chatml", HERMES, ["<tool_call>\n" + CALL + "\n</tool_call><|im_end|>\n", "It is 3 degrees.<|im_end|>\n"]),
    ("qwen", HERMES, ["<tool_call>\n" + CALL + "\n</tool_call><|im_end|>\n", "It is 3 degrees.<|im_end|>\n"]),
    ("llama3", LLAMA3, ['{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>',
                        "It is 3 degrees.<|eot_id|>"]),
    ("mistral", MISTRAL, ["[TOOL_CALLS] [" + CALL + "]<|eos|>", "It is 3 degrees.<|eos|>"]),
])
def test_each_shipped_template_renders_tools_and_puts_loss_on_the_calls_only(tok, files, name, rendered, loss):
    use_chat_template(tok, name)
    (glaive, _), _ = read_records(files[0])
    (openai,), _ = read_records(files[1])
    enc = encode([glaive, openai], tok, 4096, packing=False)
    # the schemas in the prompt, the call and the result in their turns: the exact tokens of the whole
    assert enc.input_ids[0] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert enc.input_ids[1] == enc.input_ids[0] and enc.targets[1] == enc.targets[0]  # both shapes, same tokens
    # loss on the assistant's tool call and its answer; none on the schemas, the question or the tool's result
    assert loss_pieces(tok, enc) == loss


def test_templates_that_would_drop_tools_are_refused_in_one_line(tok, files):
    (glaive, plain), _ = read_records(files[0])
    # the tiny model's own template prints each message's content only
    with pytest.raises(ShardwiseError) as e:
        encode([glaive], tok, 4096, packing=False)
    assert str(e.value) == (
        f"{files[0]}:row 1: this record has tool calls, but the model's own chat template drops tools, tool calls, "
        "their arguments; pass --chat-template chatml, qwen, llama3 or mistral (they render tools and tool calls), "
        "or a template of your own that renders `tools` and `tool_calls`")
    use_chat_template(tok, "gemma")
    with pytest.raises(ShardwiseError) as e:
        encode([plain], tok, 4096, packing=False)  # only its `tools`: those would be lost too
    assert str(e.value) == (
        f"{files[0]}:row 2: this record has tool calls, but the chat template 'gemma' cannot render them (gemma has "
        "no tool-call format); pass --chat-template chatml, qwen, llama3 or mistral (they render tools and tool "
        "calls), or a template of your own that renders `tools` and `tool_calls`")


class Spy:
    """The tokenizer, recording the longest text it was asked to tokenize (alone or in a batch)."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        self.longest = max([self.longest] + [len(t) for t in ([text] if isinstance(text, str) else text)])
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_memory_per_record_stays_bounded_with_huge_schemas_and_calls(tok):
    use_chat_template(tok, "chatml")
    seq = 64
    budget = (seq + 1) * CHARS_PER_TOKEN_BOUND
    big = {"type": "function", "function": {**WEATHER, "description": "stone " * 200_000}}
    call = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo " * 200_000}}}]
    recs = [Record("chat", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "t:1",
                   [{"type": "function", "function": WEATHER}, big]),
            Record("chat", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": call},
                            {"role": "tool", "content": "3"}, {"role": "assistant", "content": "done"}], "t:2",
                   [{"type": "function", "function": WEATHER}]),
            Record("chat", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "t:3")]
    spy = Spy(tok)
    enc = encode(recs, spy, seq, packing=False)
    assert spy.longest < budget + 600  # the budget plus the template's own words and markers
    assert enc.stats["truncated"] == 2


@pytest.mark.parametrize("record, line", [
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "get_weather(Oslo)"}]},
     "message 2: the 'function_call' turn is not JSON; a function call is {\"name\": ..., \"arguments\": {...}}"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{city: Oslo}"}}]}]},
     "message 2: the arguments of call 'f' are not JSON"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": "[{oops"},
     "field 'tools' is not JSON; it holds a list of function schemas [{\"name\": ..., \"description\": ..., "
     "\"parameters\": {...}}]"),
])
def test_bad_tool_records_say_what_and_where(tmp_path, record, line):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(record) + "\n")
    with pytest.raises(ShardwiseError) as e:
        read_records(str(f))
    assert str(e.value).startswith(f"{f}:1: {line} (format ")


def test_multi_part_text_content_is_joined_and_media_refused(tmp_path):
    f = tmp_path / "parts.jsonl"
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "Name "},
                                                       {"type": "text", "text": "a colour."}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Green."}]}]},
            # LLaMA-Factory v1's parts name the text `value`
            {"messages": [{"role": "user", "content": [{"type": "text", "value": "Hi"}]},
                          {"role": "assistant", "content": [{"type": "text", "value": "Hello"}]}]},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}},
                                                       {"type": "text", "text": "What is this?"}]},
                          {"role": "assistant", "content": "A cat."}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ShardwiseError) as e:
        read_records(str(f))
    assert str(e.value) == (f"{f}:3: message 1 has an 'image_url' part: this is text-only fine-tuning (no image, "
                            "audio or video inputs); drop the record or keep only its text parts (format messages); "
                            "fix the record or pass --skip-bad-records")
    recs, stats = read_records(str(f), skip_bad=True)
    assert [r.payload for r in recs] == [
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Green."}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]]
    assert stats.skipped == 1


def test_preference_pairs_are_named_with_what_to_do(tmp_path):
    dpo = tmp_path / "dpo_en_demo.json"  # LLaMA-Factory's shape: a conversation, then two answer turns
    dpo.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Pick a number."}],
                                "chosen": {"from": "gpt", "value": "7"}, "rejected": {"from": "gpt", "value": "no"}}]))
    with pytest.raises(ShardwiseError) as e:
        read_records(str(dpo), skip_bad=True)  # a whole file of them, not bad records to skip
    assert str(e.value) == (
        f"{dpo}:row 1: this is a preference pair ('chosen' and 'rejected' answers), data for DPO-style training, "
        "which supervised fine-tuning (--task sft) does not take; pass --task dpo to train on the pairs "
        "(docs/dpo.md), or, to fine-tune on the chosen answers, write them as conversations ending in that answer")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Pick a number.", "chosen": "7", "rejected": "no"}) + "\n")
    with pytest.raises(ShardwiseError) as e:
        read_records(str(pairs))
    assert str(e.value) == (
        f"{pairs}:1: this is a preference pair ('chosen' and 'rejected' answers), data for DPO-style training, "
        "which supervised fine-tuning (--task sft) does not take; pass --task dpo to train on the pairs "
        "(docs/dpo.md), or, to fine-tune on the chosen answers, pass --columns prompt=instruction,chosen=output")
    # and with --task dpo both files train as pairs
    assert read_records(str(dpo), preference=True)[0][0].chosen == {"role": "assistant", "content": "7"}
    assert read_records(str(pairs), preference=True)[0][0].rejected == {"role": "assistant", "content": "no"}
    # and what it says works
    (rec,), _ = read_records(str(pairs), columns={"prompt": "instruction", "chosen": "output"})
    assert rec.payload == [{"role": "user", "content": "Pick a number."}, {"role": "assistant", "content": "7"}]


def test_a_template_file_of_ones_own_that_renders_tools_is_taken_and_one_that_does_not_is_named(tok, files, tmp_path):
    own = tmp_path / "own.jinja"
    own.write_text("{% if tools %}[tools]{{ tools | tojson }}\n{% endif %}{% for m in messages %}[{{ m['role'] }}]"
                   "{{ m['content'] }}{% for c in m.get('tool_calls', []) %}{{ c['function'] | tojson }}{% endfor %}\n"
                   "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    use_chat_template(tok, str(own))
    (glaive, _), _ = read_records(files[0])
    enc = encode([glaive], tok, 4096, packing=False)
    # (transformers renders with trim_blocks: the newline after a block tag goes)
    assert loss_pieces(tok, enc) == ['{"name": "get_weather", "arguments": {"city": "Oslo"}}', "It is 3 degrees."]
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}")
    use_chat_template(tok, str(plain))
    with pytest.raises(ShardwiseError, match=rf"row 1: this record has tool calls, but the chat template {plain} "
                                             r"drops tools, tool calls, their arguments; pass --chat-template"):
        encode([glaive], tok, 4096, packing=False)
