"""Production settings: the secret key never lives in the code, and a production environment
(``DJANGO_DEBUG=0``, a key, hosts, ``DJANGO_HTTPS=1``) passes ``check --deploy`` with no warning."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

from django.conf import settings

BASE_DIR = Path(settings.BASE_DIR)
PRINT_SETTINGS = ("import django, json; django.setup(); from django.conf import settings as s; "
                  "print(json.dumps({'key': s.SECRET_KEY, 'secure': [s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, "
                  "s.SECURE_SSL_REDIRECT, s.SECURE_HSTS_SECONDS, s.SECURE_PROXY_SSL_HEADER]}))")


def clean_env(**overrides: str) -> dict[str, str]:
    """This environment without any DJANGO_* variable or database URL, plus ``overrides``."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("DJANGO_") and key not in ("DATABASE_URL", "REDIS_URL")}
    env.update({"DJANGO_SETTINGS_MODULE": "orchestrator_site.settings", **overrides})
    return env


def settings_in_child(**env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PRINT_SETTINGS], cwd=BASE_DIR, env=clean_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_without_a_key_one_is_made_once_kept_private_and_shared_by_processes_starting_together(tmp_path):
    import json

    key_file = tmp_path / "var" / "secret_key"
    children = [settings_in_child(DJANGO_SECRET_KEY_FILE=str(key_file)) for _ in range(4)]
    keys = set()
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        keys.add(json.loads(out)["key"])
    assert len(keys) == 1
    key = keys.pop()
    assert len(key) >= 50 and key == key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert [path.name for path in key_file.parent.iterdir()] == ["secret_key"]  # no temporary file left
    again = settings_in_child(DJANGO_SECRET_KEY_FILE=str(key_file))
    out, err = again.communicate(timeout=120)
    assert json.loads(out)["key"] == key  # reused, not replaced


def test_the_environment_key_wins_and_no_file_is_made(tmp_path):
    import json

    key_file = tmp_path / "secret_key"
    child = settings_in_child(DJANGO_SECRET_KEY="k" * 60, DJANGO_SECRET_KEY_FILE=str(key_file))
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert json.loads(out)["key"] == "k" * 60
    assert not key_file.exists()


def test_a_truncated_key_file_stops_start_up_loudly(tmp_path):
    key_file = tmp_path / "secret_key"
    key_file.write_text("short\n")
    child = settings_in_child(DJANGO_SECRET_KEY_FILE=str(key_file))
    _, err = child.communicate(timeout=120)
    assert child.returncode != 0 and "holds no usable secret key" in err


def test_the_settings_module_holds_no_secret_key():
    source = (BASE_DIR / "orchestrator_site" / "settings.py").read_text()
    assert "insecure" not in source.lower()


def test_https_turns_on_secure_cookies_hsts_redirect_and_the_proxy_header(tmp_path):
    import json

    plain = settings_in_child(DJANGO_SECRET_KEY="k" * 60)
    secure = settings_in_child(DJANGO_SECRET_KEY="k" * 60, DJANGO_HTTPS="1")
    assert json.loads(plain.communicate(timeout=120)[0])["secure"] == [False, False, False, 0, None]
    assert json.loads(secure.communicate(timeout=120)[0])["secure"] == [
        True, True, True, 31_536_000, ["HTTP_X_FORWARDED_PROTO", "https"]]


def deploy_check(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
                          cwd=BASE_DIR, env=clean_env(**env), capture_output=True, text=True, timeout=300)


def test_the_documented_production_environment_passes_check_deploy():
    production = {"DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": secrets.token_urlsafe(64),
                  "DJANGO_ALLOWED_HOSTS": "console.example.com"}
    passed = deploy_check(**production, DJANGO_HTTPS="1")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "no issues" in passed.stdout
    without_https = deploy_check(**production)
    assert without_https.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in without_https.stderr
