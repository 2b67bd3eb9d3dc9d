"""The files ``file_digest`` checks and ``file_sha256`` pins may read: confined to their root
(``var/pipeline-files/`` by default), never the database or the artifacts, no symlink out, and a
size cap on hashing."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
from django.db import connection

from runs.pipeline.checks import CheckContext, check_evaluate, check_get, file_roots
from runs.pipeline.pins import PIN_PROVIDERS, pin_compute

ZERO = "0" * 64


def digest_check(path):
    return check_evaluate("file_digest", {"path": str(path), "sha256": ZERO}, CheckContext(run=None))


def plan_errors(path):
    """What a plan naming ``path`` in a check and in a pin is told."""
    return (check_get("file_digest").validate({"path": str(path), "sha256": ZERO})
            + PIN_PROVIDERS["file_sha256"].validate({"path": str(path)}))


def pin(path):
    return pin_compute("file_sha256", {"path": str(path)}, None)


@pytest.fixture
def root(tmp_path, settings):
    directory = tmp_path / "root"
    directory.mkdir()
    settings.ORCHESTRATOR_PIPELINE_FILE_ROOTS = [str(directory)]
    return directory


def test_the_default_root_is_its_own_directory_created_when_needed(settings):
    expected = str(Path(settings.BASE_DIR) / "var" / "pipeline-files")
    assert file_roots() == [expected] and os.path.isdir(expected)
    database = Path(connection.settings_dict["NAME"]) if connection.vendor == "sqlite" else None
    assert database is None or not str(database).startswith(expected + os.sep)
    assert not str(settings.ORCHESTRATOR_ARTIFACT_ROOT).startswith(expected + os.sep)


@pytest.mark.django_db
def test_the_sqlite_database_is_refused_by_default():
    if connection.vendor != "sqlite":
        pytest.skip("the database is a file on SQLite only")
    database = connection.settings_dict["NAME"]
    assert os.path.isfile(database)
    assert plan_errors(database) == ["path: the database and the artifacts cannot be read by checks or pins"] * 2
    assert pin(database) is None
    result = digest_check(database)
    assert result.invariants == {"file_readable": False, "sha256_matches": False}
    assert result.details["code"] == "path_not_allowed" and result.details["actual"] is None


def test_an_artifact_is_refused_by_default(settings, tmp_path):
    artifact = Path(settings.ORCHESTRATOR_ARTIFACT_ROOT) / "run-1" / "report.txt"
    assert plan_errors(artifact) == ["path: the database and the artifacts cannot be read by checks or pins"] * 2
    assert digest_check(artifact).details["code"] == "path_not_allowed"


@pytest.mark.django_db
def test_the_database_and_artifacts_stay_refused_under_a_root_that_holds_them(settings, tmp_path):
    artifacts = tmp_path / "artifacts"
    (artifacts / "run-1").mkdir(parents=True)
    artifact = artifacts / "run-1" / "report.txt"
    artifact.write_bytes(b"secret report")
    settings.ORCHESTRATOR_ARTIFACT_ROOT = artifacts
    settings.ORCHESTRATOR_PIPELINE_FILE_ROOTS = [str(tmp_path)]
    assert plan_errors(artifact) == ["path: the database and the artifacts cannot be read by checks or pins"] * 2
    assert pin(artifact) is None and digest_check(artifact).details["code"] == "path_not_allowed"
    if connection.vendor == "sqlite":
        database = Path(connection.settings_dict["NAME"])
        settings.ORCHESTRATOR_PIPELINE_FILE_ROOTS = [str(database.parent)]
        for path in (database, Path(f"{database}-wal")):
            assert "the database and the artifacts" in plan_errors(path)[0]
            assert pin(path) is None and digest_check(path).details["code"] == "path_not_allowed"


def test_a_file_in_the_root_is_hashed(root):
    (root / "sub").mkdir()
    manifest = root / "sub" / "manifest.txt"
    manifest.write_bytes(b"doc v3\n")
    expected = hashlib.sha256(b"doc v3\n").hexdigest()
    assert plan_errors(manifest) == [] and pin(manifest) == expected
    result = check_evaluate("file_digest", {"path": str(manifest), "sha256": expected}, CheckContext(run=None))
    assert result.passed and result.details["actual"] == expected


def test_a_symlink_out_of_the_root_is_refused(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_bytes(b"secret")
    (root / "link.txt").symlink_to(secret)
    (root / "linkdir").symlink_to(outside, target_is_directory=True)
    for path in (root / "link.txt", root / "linkdir" / "secret.txt"):
        assert any("symlink leading out" in message for message in plan_errors(path))
        assert pin(path) is None
        assert digest_check(path).details["code"] == "path_not_allowed"


def test_a_symlink_within_the_root_is_followed(root):
    (root / "real.txt").write_bytes(b"data")
    (root / "alias.txt").symlink_to(root / "real.txt")
    assert pin(root / "alias.txt") == hashlib.sha256(b"data").hexdigest()


def test_dot_dot_and_relative_paths_are_refused(root, tmp_path):
    (tmp_path / "outside.txt").write_bytes(b"secret")
    assert plan_errors(f"{root}/../outside.txt") == ["path: must not contain '..'"] * 2
    assert plan_errors(f"{root}/sub/../inside.txt") == ["path: must not contain '..'"] * 2
    assert plan_errors("outside.txt") == ["path: must be an absolute path"] * 2
    assert pin(f"{root}/../outside.txt") is None


def test_a_file_over_the_size_cap_is_refused_without_hashing(root, settings):
    settings.ORCHESTRATOR_PIPELINE_FILE_MAX_BYTES = 10
    small, large = root / "small.bin", root / "large.bin"
    small.write_bytes(b"x" * 10)
    large.write_bytes(b"x" * 11)
    assert pin(small) == hashlib.sha256(b"x" * 10).hexdigest()
    assert pin(large) is None
    result = digest_check(large)
    assert result.invariants == {"file_readable": False, "sha256_matches": False}
    assert result.details["code"] == "file_too_large"
    assert "11 bytes, over the cap of 10 bytes" in result.details["error"]


def test_a_fifo_is_refused_without_waiting_for_a_writer(root):
    fifo = root / "pipe"
    os.mkfifo(fifo)
    results = []
    reader = threading.Thread(target=lambda: results.append(digest_check(fifo)), daemon=True)
    reader.start()
    reader.join(5)
    assert results, "hashing a FIFO blocked"
    assert results[0].details["code"] == "path_not_allowed" and "not a regular file" in results[0].details["error"]
