"""Every results JSON that the README, docs/benchmarks.md or the results index cites records
the run it came from: the CPU, the weight format, the commit and the command
(benchmarks/run_info.py writes them; older files carry what is known, "unknown" otherwise)."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CITING = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md", RESULTS / "README.md")
FIELDS = ("cpu", "weights", "commit", "command")


def cited() -> list[str]:
    names = set()
    for doc in CITING:
        names |= set(re.findall(r"[\w.-]+\.json\b", doc.read_text()))
    return sorted(n for n in names if (RESULTS / n).is_file())


def test_the_docs_cite_results_files():
    assert {"bench_gsm8k30.json", "peers.json", "serving_c1c4c16.json"} <= set(cited())


@pytest.mark.parametrize("name", cited())
def test_a_cited_result_records_its_run(name):
    data = json.loads((RESULTS / name).read_text())
    missing = [f for f in FIELDS if not data.get(f)]
    assert not missing, f"{name} lacks {missing}: write it with benchmarks/run_info.py"
