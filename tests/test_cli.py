import json
import os

from conftest import run_cli


def test_help_documents_every_command():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("tune", "list"):
        assert command in result.stdout
    tune_help = run_cli("tune", "--help").stdout
    for option in ("--pattern", "--shape", "--trials", "--space", "--db", "--target", "--seed"):
        assert option in tune_help


def test_list_shows_every_pattern_with_its_templates():
    from autofuse.registry import all_patterns
    result = run_cli("list", "--db", "/nonexistent-db-root")
    assert result.returncode == 0, result.stderr
    for pattern in all_patterns().values():
        assert pattern.name in result.stdout
        for template in pattern.templates:
            assert template.name in result.stdout


def test_tune_prints_the_result_table(tuned_db):
    _, result = tuned_db
    header = result.stdout.splitlines()[0]
    for column in ("pattern", "best ms", "GFLOP/s", "GB/s", "untuned ms", "speed-up", "time s"):
        assert column in header
    assert "linear_bias_relu" in result.stdout
    assert "trials/min" in result.stdout


def test_tune_json_has_the_rows(tuned_db):
    root, _ = tuned_db
    payload = json.loads((root / "rows.json").read_text())
    (row,) = payload["rows"]
    assert row["pattern"] == "linear_bias_relu" and row["trials"] == 8
    assert row["best_ms"] > 0 and row["untuned_ms"] > 0
    assert payload["machine"]["cores"] >= 1 and payload["session"]["first_trial_secs"] > 0


def test_list_reports_stored_best(tuned_db):
    root, _ = tuned_db
    result = run_cli("list", "--db", str(root))
    assert result.returncode == 0, result.stderr
    assert "best ms" in result.stdout
    # the tuned workload is the small shape, so the default-shape row shows no record
    assert os.path.isdir(root)
