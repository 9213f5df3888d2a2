"""Every MKRT_* variable is in the README's table, and read through mkrt.envs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mkrt import envs

ROOT = Path(__file__).resolve().parents[1]


def test_readme_lists_every_variable_exactly():
    readme = (ROOT / "README.md").read_text()
    assert envs.markdown_table() in readme, "README's variable table is out of date: paste envs.markdown_table()"


def test_code_reads_no_unlisted_variable():
    used = set()
    for path in (ROOT / "mkrt").rglob("*.py"):
        used |= set(re.findall(r"MKRT_[A-Z_]+[A-Z]", path.read_text()))
    unlisted = used - set(envs.VARIABLES)
    assert not unlisted, f"variables used but not in mkrt/envs.py: {sorted(unlisted)}"


def test_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("MKRT_WAIT_TIMEOUT_MS", "soon")
    with pytest.raises(ValueError, match="MKRT_WAIT_TIMEOUT_MS"):
        envs.get("MKRT_WAIT_TIMEOUT_MS")
    with pytest.raises(KeyError):
        envs.get("MKRT_NOT_A_VARIABLE")
