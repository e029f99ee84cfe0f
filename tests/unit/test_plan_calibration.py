"""The planner's fitted constants come from one data file (src/shardwise/plan/calibration.json), installed with the
package; docs/planner.md's table of them and its accuracy tables (today's predictions for every measured set the file
names, and the archived rows) are generated, and the page must match what the generator writes."""

from __future__ import annotations

from pathlib import Path

import tomllib

from shardwise.plan import calibration, comm, decide, memory

ROOT = Path(__file__).resolve().parents[2]


def test_every_entry_says_what_it_was_fitted_on():
    for name, e in calibration.entries().items():
        assert isinstance(e["value"], (int, float)), name
        assert e["unit"] and e["hardware"] and e["used_by"] and e["means"], name
        # a fitted constant names its measured rows and their files; an assumption says it is one
        assert (e["rows"] and e["fitted_on"]) or "not a fit" in e["hardware"], name


def test_the_planner_reads_its_constants_from_the_file():
    v = calibration.value
    assert (decide.EAGER_MFU, decide.COMPILED_MFU) == (v("eager_mfu"), v("compiled_mfu"))
    assert (decide.EAGER_MFU_WIDTH, decide.EAGER_MFU_PER_DOUBLING) == (v("eager_mfu_width"),
                                                                       v("eager_mfu_per_width_doubling"))
    assert memory.COMPILE_ACT_FACTOR == v("compile_act_factor")
    assert memory.CUDA_CONTEXT_GIB == v("cuda_context_gib")
    assert comm.FLOAT8_CAST_BYTES == v("float8_cast_bytes")
    assert comm.STRATEGY_BYTES_PER_PARAM["zero12"] == v("strategy_bytes_per_param.zero12")
    assert comm.ZERO3_BLOCK_S_PER_TENSOR_PASS == v("zero3_block_s_per_tensor_pass")


def test_the_file_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["shardwise"]
    assert "plan/*.json" in data and calibration.FILE.parent.name == "plan"


def test_docs_planner_generated_blocks_match_the_planner_and_the_data():
    """Every generated block of the page is what `python -m shardwise.plan.calibration docs/planner.md` writes now: a
    change to a constant, to the planner's model or to a measured set moves a prediction, and this fails until the
    page is regenerated."""
    page = (ROOT / "docs" / "planner.md").read_text(encoding="utf-8")
    present, expected = calibration.page_blocks(page), calibration.doc_blocks(ROOT)
    assert sorted(present) == sorted(expected), "docs/planner.md's generated blocks differ from the generator's names"
    stale = [name for name in expected if present[name] != expected[name]]
    assert not stale, f"docs/planner.md is stale ({', '.join(stale)}): {calibration.REGENERATE}"


def test_every_measured_set_has_a_table_on_the_page():
    page = calibration.page_blocks((ROOT / "docs" / "planner.md").read_text(encoding="utf-8"))
    for name in calibration._load()["measured_sets"]:
        assert f"accuracy {name}" in page, name
    assert "accuracy archived" in page and "constants" in page
