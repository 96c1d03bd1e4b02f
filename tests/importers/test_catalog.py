"""docs/peer-recipes.md is what the importers make of every peer recipe kept in tests/data/peers
(regenerate: python -m digen.importers.catalog tests/data/peers > docs/peer-recipes.md)."""

from __future__ import annotations

from pathlib import Path

from digen.importers.catalog import markdown, rows

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "tests" / "data" / "peers"


def test_the_page_is_the_importers_output_and_every_recipe_has_a_row():
    table = rows(PEERS)
    assert markdown(table) == (ROOT / "docs" / "peer-recipes.md").read_text()
    scripts = {p for p in (PEERS / "verl_omni" / "examples").rglob("*.sh")}
    assert sum(r.peer == "verl-omni" for r in table) == len(scripts)
    assert sum(r.peer == "dance-grpo" for r in table) == len(
        list((PEERS / "dance_grpo" / "scripts" / "finetune").glob("*.sh"))
    )
    by = {(r.peer, r.recipe): r for r in table}
    # the headline recipes import as the algorithm they train; the refused ones say why in a line
    assert by["flow-grpo", "grpo.py:pickscore_sd3"].algorithm == "flow-grpo"
    assert by["flow-grpo", "grpo_guard.py:general_ocr_sd3_rationorm"].algorithm == "grpo-guard"
    assert (
        by["verl-omni", "examples/grpoguard_trainer/qwen_image/run_qwen_image_ocr_lora.sh"].algorithm
        == "grpo-guard"
    )
    assert by["dance-grpo", "scripts/finetune/finetune_flux_grpo_8gpus_lora.sh"].imported
    assert "mini_num_image_per_prompt" in by["flow-grpo", "grpo.py:pickscore_sd3_fast"].note
    assert all(r.note and "\n" not in r.note for r in table if not r.imported)
    assert "sample.noise_level" in by["flow-grpo", "grpo.py:general_ocr_wan2_1"].note  # loud where it differs
