import pytest

from jobs import registry, wake


@pytest.fixture
def define_job():
    """Register job definitions for one test and remove them afterwards."""
    added: list[str] = []

    def define(**kwargs):
        definition = registry.register(registry.JobDefinition(**kwargs))
        added.append(definition.type)
        return definition

    yield define
    for job_type in added:
        registry._REGISTRY.pop(job_type, None)


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    """In-process tests claim jobs themselves; no django-q2 message is needed. Each test counts the
    deployment's live workers afresh (``jobs.wake.worker_count`` keeps its count a few seconds)."""
    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    monkeypatch.setitem(wake._workers_seen, "at", float("-inf"))
