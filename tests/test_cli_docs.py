"""docs/cli.md is generated from the parsers, and every option has a line of help."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_d3d import cli_docs

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch):
    """Defaults that read the environment render as on a machine without it."""
    monkeypatch.delenv("D3D_API_KEY", raising=False)
    monkeypatch.delenv("D3D_DATASETS", raising=False)


def test_cli_page_matches_the_parsers():
    assert DOC.read_text() == cli_docs.render(), (
        "docs/cli.md is stale: python -m sglang_d3d.cli_docs > docs/cli.md"
    )


@pytest.mark.parametrize("name", list(cli_docs.command_parsers()))
def test_every_option_has_help(name):
    parser = cli_docs.command_parsers()[name]
    silent = [a.option_strings or a.dest for a in cli_docs.documented_actions(parser) if not a.help]
    assert not silent, f"d3d {name}: options without help: {silent}"


def test_every_command_is_documented():
    text = DOC.read_text()
    for name in cli_docs.command_parsers():
        assert f"## `d3d {name}`" in text
