"""The house's rules that a wrong import would break (README "Layout").

The apps depend downwards only (core < billing < jobs < runs < diagnosis < console): import-linter
checks the imports, and no app reaches a model of an app above it by name (``apps.get_model``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APPS = ("core", "billing", "jobs", "runs", "diagnosis", "console")


def test_the_apps_import_downwards_only():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_no_app_reaches_a_model_by_name():
    offenders = []
    for app in APPS:
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" in path.parts:
                continue  # historical models in data migrations are how Django wants them
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\bapps\.get_model\(", line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}")
    assert offenders == []
