"""task dpo's parts on their own: the preference formats (LLaMA-Factory, TRL, ms-swift) and their one-line refusals,
pairs that share the prompt's tokens, the sampler keeping a pair in one micro-batch, the loss formulas, the chunked
per-token log-probabilities, and the config's refusals of nonsense combinations."""

import argparse
import dataclasses
import json
import math

import pytest
import torch

from shardwise import config
from shardwise.data.batches import DataPosition, StepSampler
from shardwise.data.encode import IGNORE, encode
from shardwise.data.sources import read_records
from shardwise.errors import ShardwiseError
from shardwise.models.load import load_tokenizer
from shardwise.models.speed import linear_token_logprobs, token_logprobs
from shardwise.models.tiny import tiny_dir
from shardwise.train.objective import preference_loss
from tests.helpers import write_jsonl

U = {"role": "user", "content": "What is two plus two?"}
RECORDS = {
    "lf-sharegpt": {"conversations": [{"from": "human", "value": U["content"]}], "system": "Be brief.",
                    "chosen": {"from": "gpt", "value": "four"}, "rejected": {"from": "gpt", "value": "five"}},
    "lf-alpaca": {"instruction": "What is two plus two?", "chosen": "four", "rejected": "five"},
    "lf-messages": {"messages": [U], "chosen": {"role": "assistant", "content": "four"},
                    "rejected": {"role": "assistant", "content": "five"}},
    "trl": {"prompt": [U], "chosen": [{"role": "assistant", "content": "four"}],
            "rejected": [{"role": "assistant", "content": "five"}]},
    "trl-strings": {"prompt": U["content"], "chosen": "four", "rejected": "five"},
    "trl-implicit": {"chosen": [U, {"role": "assistant", "content": "four"}],
                     "rejected": [U, {"role": "assistant", "content": "five"}]},
    "swift": {"messages": [U, {"role": "assistant", "content": "four"}], "rejected_response": "five"},
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_dir(0), False)


@pytest.mark.parametrize("name", list(RECORDS))
def test_every_preference_form_reads_as_the_same_pair(tmp_path, name):
    path = write_jsonl(str(tmp_path / "p.jsonl"), [RECORDS[name]] * 2)
    (rec, _), _ = read_records(path, preference=True)
    assert rec.kind == "pair" and rec.payload[-1] == U and rec.source == f"{path}:1"
    assert (rec.chosen["content"], rec.rejected["content"]) == ("four", "five")
    assert rec.payload[0] == ({"role": "system", "content": "Be brief."} if name == "lf-sharegpt" else U)


def test_a_bad_pair_is_one_line_with_its_file_and_line(tmp_path):
    path = write_jsonl(str(tmp_path / "p.jsonl"), [RECORDS["trl"], {"prompt": [U], "chosen": 3, "rejected": "x"}])
    with pytest.raises(ShardwiseError, match=rf"^{path}:2: field 'chosen' must be a string or one assistant turn"):
        read_records(path, preference=True)
    sft = write_jsonl(str(tmp_path / "sft.jsonl"), [{"messages": [U, {"role": "assistant", "content": "4"}]}])
    with pytest.raises(ShardwiseError, match=rf"^{sft}:1: not a preference record .* or train it with --task sft"):
        read_records(sft, preference=True)


def test_preference_data_without_task_dpo_keeps_the_sft_refusal(tmp_path):
    path = write_jsonl(str(tmp_path / "p.jsonl"), [RECORDS["lf-sharegpt"]])
    with pytest.raises(ShardwiseError, match="this is a preference pair"):
        read_records(path)


def test_chosen_and_rejected_rows_share_the_prompts_tokens(tmp_path, tok):
    path = write_jsonl(str(tmp_path / "p.jsonl"), [RECORDS["trl"], RECORDS["trl-strings"]])
    enc = encode(read_records(path, preference=True)[0], tok, 64, packing=False)
    assert len(enc) == 4 and enc.stats["pairs"] == 2
    for c, r in ((0, 1), (2, 3)):
        start = next(i for i, t in enumerate(enc.targets[c]) if t != IGNORE)  # the prompt's last token
        assert enc.input_ids[c][:start + 1] == enc.input_ids[r][:start + 1]
        assert all(t == IGNORE for t in enc.targets[r][:start])
        assert tok.decode([t for t in enc.targets[c] if t != IGNORE]).startswith("four")
        assert tok.decode([t for t in enc.targets[r] if t != IGNORE]).startswith("five")


def test_the_sampler_keeps_each_pair_in_one_micro_batch(tok):
    from shardwise.data.preference import demo_pairs

    enc = encode(demo_pairs()[:40], tok, 64, packing=False)
    s = StepSampler(enc, 3, 2, 2, 1, seed=0, pad_id=0, pairs=True)
    batch, _ = s.next(DataPosition())
    assert batch.units == 12 and len(batch.rows) == 24
    for mb in batch.micro:
        b = len(mb.rows) // 2
        assert [r + 1 for r in mb.rows[:b]] == mb.rows[b:] and all(r % 2 == 0 for r in mb.rows[:b])
        for i, r in enumerate(mb.rows):
            assert mb.input_ids[i, :len(enc.input_ids[r])].tolist() == enc.input_ids[r]
    assert s.steps_per_epoch == 40 // 12


def test_the_loss_formulas():
    pol = torch.tensor([-3.0, -9.0, -7.0, -8.0])  # chosen rows, then rejected rows
    ref = torch.tensor([-4.0, -8.0, -6.0, -8.0])
    n = torch.tensor([2.0, 3.0, 4.0, 2.0])
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    beta = 0.5
    loss, rw, rl = preference_loss("sigmoid", beta, 0, pol, n, ref)
    # pair 0: log-ratios 1 and -1; pair 1: -1 and 0
    assert loss.tolist() == pytest.approx([-math.log(sig(beta * 2)), -math.log(sig(beta * -1))])
    assert rw.tolist() == pytest.approx([0.5, -0.5]) and rl.tolist() == pytest.approx([-0.5, 0.0])
    loss, _, _ = preference_loss("ipo", beta, 0, pol, n, ref)
    assert loss.tolist() == pytest.approx([(2 - 1) ** 2, (-1 - 1) ** 2])
    loss, rw, rl = preference_loss("simpo", 2.0, 0.5, pol, n, None)
    assert loss.tolist() == pytest.approx([-math.log(sig(2 * (-1.5 + 1.75) - 0.5)), -math.log(sig(2 * (-3 + 4) - 0.5))])
    assert rw.tolist() == pytest.approx([-3.0, -6.0])
    loss, _, _ = preference_loss("orpo", 0.1, 0, pol, n, None)
    odds = lambda a: a - math.log(1 - math.exp(a))  # noqa: E731
    assert loss.tolist() == pytest.approx([1.5 - 0.1 * math.log(sig(odds(-1.5) - odds(-1.75))),
                                           3.0 - 0.1 * math.log(sig(odds(-3.0) - odds(-4.0)))], rel=1e-5)


def test_chunked_log_probabilities_and_their_gradients_match_the_full_logits():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 30, (2, 9), generator=g)
    t[0, :4] = IGNORE
    up = torch.randn(2, 9, generator=g)
    got = linear_token_logprobs(h, w, t, chunk=4)
    (got * up).sum().backward()
    gh, gw = h.grad, w.grad
    h.grad = w.grad = None
    want = token_logprobs(h @ w.t(), t)
    (want * up).sum().backward()
    torch.testing.assert_close(got, want)
    assert (got[0, :4] == 0).all()
    torch.testing.assert_close(gh, h.grad)
    torch.testing.assert_close(gw, w.grad)


def flags(*argv):
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return config.flags_from_namespace(p.parse_args(list(argv)))


@pytest.mark.parametrize("argv, line", [
    (("--beta", "0.2"), r"flag --beta: beta applies to preference training; pass --task dpo"),
    (("--task", "dpo", "--beta", "0"), r"beta must be a positive number"),
    (("--task", "dpo", "--loss-type", "simpo", "--ref-model", "x"), r"loss_type simpo uses no reference model"),
    (("--task", "dpo", "--simpo-gamma", "1"), r"simpo_gamma is SimPO's margin but loss_type is sigmoid"),
    (("--task", "dpo", "--packing"), r"flag --packing: task dpo keeps each prompt's chosen and rejected"),
    (("--task", "dpo", "--tuner", "lora", "--ref-model", "x"), r"with tuner lora the reference is the base model"),
    (("--task", "dpo", "--val-split", "0.1"), r"task dpo has no validation loss yet"),
    (("--stage", "dpo", "--pref_loss", "orpo", "--precompute-ref"), r"loss_type orpo uses no reference model"),
])
def test_nonsense_combinations_are_one_line(argv, line):
    with pytest.raises(ShardwiseError, match=line):
        config.load_config(None, flags(*argv))


def test_llama_factory_spellings_set_the_task():
    c = config.load_config(None, flags("--stage", "dpo", "--pref_beta", "0.3", "--pref_loss", "ipo")).cfg
    assert (c.task, c.beta, c.loss_type) == ("dpo", 0.3, "ipo")
    assert config.from_dict(json.loads(json.dumps(dataclasses.asdict(c)))).task == "dpo"


def test_the_benchmarks_pair_count_is_the_tokens_shardwise_trains_on(tmp_path, tok):
    """benchmarks/dpo_vs_trl.py gives TRL's side the tokens a pair as shardwise encodes them (its tokens/s counts
    both rows' real tokens): the same number as the encoded rows."""
    from tests.helpers import benchmark_module

    bench = benchmark_module("dpo_vs_trl")
    data = bench.write_pairs(str(tmp_path / "pairs.jsonl"), 1, prompt_words=6, answer_words=4, vocab=40)
    per_pair, longest = bench.pair_tokens(tiny_dir(0), data)
    enc = encode(read_records(data, preference=True)[0], tok, 256, packing=False)
    assert per_pair == enc.stats["tokens"] and longest == max(len(r) for r in enc.input_ids)


def test_a_yaml_config_sets_the_task_and_its_keys(tmp_path):
    path = tmp_path / "dpo.yaml"
    path.write_text("task: dpo\nloss_type: simpo\nbeta: 2.0\nsimpo_gamma: 1.0\n")
    c = config.load_config(str(path), {}).cfg
    assert (c.task, c.loss_type, c.beta, c.simpo_gamma) == ("dpo", "simpo", 2.0, 1.0)
    path.write_text("task: dpo\nloss_type: simpo\n\nref_model: other\n")
    with pytest.raises(ShardwiseError, match=r"dpo\.yaml:4.*loss_type simpo uses no reference model"):
        config.load_config(str(path), {})
