"""`shardwise plan` prints the article's decision-tree paragraph when asked (--explain) and one line otherwise: the
paragraph came with every plan. Through the CLI's own entry point."""

from shardwise import cli

ARGS = ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu-memory", "80"]


def test_the_tree_paragraph_only_with_explain(capsys):
    assert cli.main(ARGS) == 0
    short = capsys.readouterr().out
    lines = [ln for ln in short.splitlines() if "decision tree" in ln]
    assert len(lines) == 1 and lines[0].startswith("article's decision tree: says ")
    assert lines[0].endswith(" (--explain: its path and why)")
    assert " — agree " in lines[0] or " — differ " in lines[0]
    assert "the tree comes from" not in short
    assert cli.main([*ARGS, "--explain"]) == 0
    full = capsys.readouterr().out
    assert "the tree comes from a Chinese-language article" in full
    assert "(--explain: its path and why)" not in full
    # the rest of the plan is the same either way
    strip = [ln for ln in full.splitlines() if "decision tree" not in ln and not ln.startswith("  ")]
    assert strip == [ln for ln in short.splitlines() if "decision tree" not in ln and not ln.startswith("  ")]
