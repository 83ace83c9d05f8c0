"""scripts/lint_tree.py: the text lint `make lint` runs over JSON, config and docs files."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("lint_tree", ROOT / "scripts" / "lint_tree.py")
lint_tree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lint_tree)

# Built from parts so this file itself stays clean for the lint.
MACHINE_PATH = "/" + "home" + "/someone/data.jsonl"
PROCESS_WORD = "sit" + "ting"


def test_the_tracked_tree_is_clean():
    assert lint_tree.lint(lint_tree.tracked_files(ROOT)) == []


def test_a_machine_path_in_json_fails(tmp_path):
    f = tmp_path / "manifest.json"
    f.write_text(json.dumps({"gsm8k_path": MACHINE_PATH}, indent=1))
    assert lint_tree.lint([f]) == [f"{f}:2: a machine path"]


def test_a_process_word_in_a_config_fails(tmp_path):
    f = tmp_path / "values.yaml"
    f.write_text(f"# written in one {PROCESS_WORD}\nreplicas: 1\n")
    assert lint_tree.lint([f]) == [f"{f}:1: a process word"]


def test_json_that_does_not_parse_fails(tmp_path):
    f = tmp_path / "broken.json"
    f.write_text('{"a": 1,\n}')
    assert len(lint_tree.lint([f])) == 1 and "does not parse" in lint_tree.lint([f])[0]


def test_the_command_line_exits_1_on_a_hit(tmp_path):
    f = tmp_path / "x.md"
    f.write_text(f"see {MACHINE_PATH}\n")
    assert lint_tree.main([str(f)]) == 1
    f.write_text("see data/mine.jsonl\n")
    assert lint_tree.main([str(f)]) == 0
