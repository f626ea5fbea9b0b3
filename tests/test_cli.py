import json
import os

import pytest

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


BAD_TUNE_ARGS = [
    (["--pattern", "no_such_pattern"], "unknown pattern"),
    (["--pattern", "linear_bias_relu", "--shape", "m=abc"], "not an integer"),
    (["--pattern", "linear_bias_relu", "--shape", "m=-4"], "must be positive"),
    (["--pattern", "linear_bias_relu", "--shape", "q=4"], "no shape parameter"),
    (["--pattern", "linear_bias_relu", "--shape", "m"], "key=value"),
    (["--target", "tpu"], "unknown target"),
    (["--target", "{not json"], "target JSON"),
    (["--trials", "0"], "must be positive"),
    (["--trials", "many"], "not an integer"),
    (["--space", "ansor"], "invalid choice"),
    (["--dtype", "int3"], "dtype"),
    (["--pattern", "all", "--shape", "m=8"], "one pattern"),
]


@pytest.mark.parametrize("args,expected", BAD_TUNE_ARGS, ids=[" ".join(a) for a, _ in BAD_TUNE_ARGS])
def test_bad_tune_input_is_one_line_and_exit_2(tmp_path, args, expected):
    db = tmp_path / "db"
    result = run_cli("tune", "--db", str(db), "--no-progress", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr
    assert not db.exists(), "a rejected command must not touch the database"


def test_unwritable_db_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_cli("tune", "--db", str(blocker), "--no-progress")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "not writable" in result.stderr


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
