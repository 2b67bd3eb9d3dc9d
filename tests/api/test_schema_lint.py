"""The OpenAPI schema is clean: Spectral's ``spectral:oas`` ruleset finds nothing but trailing
slashes (our paths end with ``/``), and the same essentials are checked in Python always."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.django_db

ALLOWED_RULES = {"path-keys-no-trailing-slash"}
METHODS = {"get", "put", "post", "delete", "patch", "options", "head", "trace"}


def _spectral() -> list[str] | None:
    """The Spectral command: ``SPECTRAL`` (a path), ``spectral`` on PATH, or /tmp/spectral's install."""
    configured = os.environ.get("SPECTRAL")
    if configured:
        return [configured]
    for candidate in (shutil.which("spectral"), "/tmp/spectral/node_modules/.bin/spectral"):
        if candidate and Path(candidate).exists():
            return [candidate]
    return None


@pytest.fixture
def schema_text(client) -> str:
    response = client.get("/api/schema/")
    assert response.status_code == 200
    return response.content.decode()


def operations(schema: dict):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if method in METHODS:
                yield path, method, operation


def test_every_operation_has_a_description_declared_tags_and_a_unique_id(schema_text):
    schema = yaml.safe_load(schema_text)
    declared = {tag["name"] for tag in schema.get("tags", [])}
    assert all(tag.get("description") for tag in schema.get("tags", []))
    ids = Counter()
    for path, method, operation in operations(schema):
        assert operation.get("description", "").strip(), (method, path)
        assert operation.get("summary", "").strip(), (method, path)
        assert operation.get("tags"), (method, path)
        assert set(operation["tags"]) <= declared, (method, path, operation["tags"])
        ids[operation["operationId"]] += 1
    assert [name for name, count in ids.items() if count > 1] == []
    used = {tag for _, _, operation in operations(schema) for tag in operation["tags"]}
    assert declared == used, "declared tags no operation uses"


def test_info_has_contact_and_servers(schema_text):
    schema = yaml.safe_load(schema_text)
    assert schema["info"]["contact"]["name"]
    assert schema["info"]["description"]
    assert schema["servers"] and all(server["url"] for server in schema["servers"])


def test_spectral_oas_ruleset_reports_only_trailing_slashes(schema_text, tmp_path):
    command = _spectral()
    if command is None:
        pytest.skip("Spectral is not installed: npm install --prefix /tmp/spectral @stoplight/spectral-cli@6.16.3 "
                    "(or set SPECTRAL to its binary)")
    (tmp_path / "schema.yaml").write_text(schema_text)
    (tmp_path / ".spectral.yaml").write_text('extends: ["spectral:oas"]\n')
    result = subprocess.run([*command, "lint", "--ruleset", str(tmp_path / ".spectral.yaml"), "--format", "json",
                             "--fail-severity", "error", "--quiet", str(tmp_path / "schema.yaml")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode in (0, 1), result.stderr
    findings = json.loads(result.stdout or "[]")
    unexpected = [(finding["code"], ".".join(map(str, finding["path"])), finding["message"])
                  for finding in findings if finding["code"] not in ALLOWED_RULES]
    assert unexpected == []
    assert any(finding["code"] == "path-keys-no-trailing-slash" for finding in findings)
