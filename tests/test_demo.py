"""`hf-sms demo --quick`: the main job, end to end, as CI runs it."""

import json

from hf_sms.cli import main
from hf_sms.records.results import format_table


def test_demo_quick_writes_every_row(tmp_path, capsys):
    assert main(["demo", "--quick", "--output-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    expected = {"sms_uniform", "best_candidate", "best_candidate_by_test", "mean_candidate", "imp", "imp_mx"}
    assert set(results["rows"]) == expected
    assert all(len(rows) == len(results["phases"]) for rows in results["rows"].values())
    assert results["phases"][-1] == 0.98
    assert abs(results["rows"]["sms_uniform"][-1]["sparsity"] - 0.98) < 1e-4
    assert all("ensemble_test" in d and "disagreement_val" in d for d in results["sms"])
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    soup = tmp_path / "final_soup"
    assert json.loads((soup / "sparsity.json").read_text())["recipe"]["m"] == [2, 2]
    out = capsys.readouterr().out
    assert format_table([results]).splitlines()[0] in out
    assert "| SMS (uniform) |" in out and "| IMP_mx |" in out
