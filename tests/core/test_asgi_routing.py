"""Production ASGI routing carries no benchmark code; the benchmark serves its own module."""

import json
import os
import subprocess
import sys
from pathlib import Path

BASE = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import {module} as site
routes = [str(route.pattern) for route in site.websocket_routes]
assert site.application is not None
print(json.dumps({{"bench_modules": sorted(m for m in sys.modules if m == "bench" or m.startswith("bench.")),
                  "routes": routes}}))
"""


def probe(module: str) -> dict:
    env = {**os.environ, "ORCHESTRATOR_BENCH": "1", "DJANGO_SETTINGS_MODULE": "orchestrator_site.settings"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], cwd=BASE, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_site_asgi_imports_nothing_from_bench_even_with_the_old_bench_switch():
    site = probe("orchestrator_site.asgi")
    assert site["bench_modules"] == []
    assert site["routes"] == ["ws/events/"]


def test_bench_asgi_adds_the_baseline_route_to_the_site_routes():
    bench = probe("bench.asgi")
    assert bench["routes"] == ["ws/events/", "ws/bench/"]
    assert "bench.channels_baseline" in bench["bench_modules"]
