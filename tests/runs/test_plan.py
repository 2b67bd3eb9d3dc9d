"""Plan validation (DESIGN §2.2): field-level errors keyed by path, nothing written on a bad plan."""

from __future__ import annotations

import copy

import pytest

from billing.models import LedgerEntry
from core.errors import ValidationFailed
from core.models import AuditRecord, Event
from runs import services
from runs.models import Agent, Run, Step
from runs.plan import plan_cost_estimate, plan_validate
from tests.conftest import make_plan

DESIGN_PLAN = {
    "max_agents": 10,
    "agents": [
        {"name": "research", "failure_mode": "fail-fast", "parallelism_mode": "dag",
         "tasks": [
             {"name": "fetch", "failure_mode": "retry", "parallelism_mode": "sequential",
              "depends_on": [],
              "steps": [
                  {"name": "hello", "tool": "echo", "args": {"text": "hi"}},
                  {"name": "wait", "tool": "sleep", "args": {"seconds": 0.2}},
                  {"name": "drill", "tool": "fail", "args": {"mode": "retryable", "times": 2}},
              ]},
             {"name": "report", "depends_on": ["fetch"],
              "steps": [{"name": "gate", "kind": "approval", "gate": "publish"}]},
         ]},
    ],
}


def errors_of(plan) -> dict[str, list[str]]:
    with pytest.raises(ValidationFailed) as raised:
        plan_validate(plan)
    assert raised.value.code == "validation_error"
    return raised.value.errors


def edited(change) -> dict:
    """The DESIGN plan with one change applied."""
    plan = copy.deepcopy(DESIGN_PLAN)
    change(plan)
    return plan


def test_the_design_example_plan_is_valid_and_creates_a_run(project):
    assert plan_validate(copy.deepcopy(DESIGN_PLAN)) == DESIGN_PLAN
    # echo, sleep and fail cost 1 per attempt, three tries each; the approval gate costs nothing.
    assert plan_cost_estimate(DESIGN_PLAN) == 9
    run = services.run_create(project=project, name="design example", plan=copy.deepcopy(DESIGN_PLAN))
    assert (run.status, run.credit_limit, run.max_agents) == (Run.Status.CREATED, 9, 10)
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    agent = Agent.objects.get(run=run)
    assert (agent.name, agent.failure_mode, agent.parallelism_mode) == ("research", "fail-fast", "dag")
    assert list(agent.tasks.values_list("name", "failure_mode", "depends_on")) == [
        ("fetch", "retry", []), ("report", "fail-fast", ["fetch"])]
    steps = {s.name: s for s in Step.objects.filter(run=run)}
    assert (steps["gate"].kind, steps["gate"].args, steps["gate"].max_tries) == ("approval", {"gate": "publish"}, 1)
    assert (steps["drill"].tool, steps["drill"].args, steps["drill"].max_tries) == (
        "fail", {"mode": "retryable", "times": 2}, 3)


def test_defaults_fill_in_what_the_plan_leaves_out(project):
    run = services.run_create(project=project, name="minimal", plan=make_plan())
    assert (run.max_agents, run.failure_mode, run.priority, run.max_attempts) == (10, "fail-fast", 100, 3)


@pytest.mark.parametrize("plan", [None, [], "a plan", 42, ["agents"]], ids=repr)
def test_a_plan_that_is_not_an_object_is_refused(plan):
    assert errors_of(plan) == {"plan": ["must be a JSON object"]}


FIELD_ERRORS = [
    (lambda p: p["agents"][0]["tasks"][1]["steps"].__setitem__(0, {"name": "x", "tool": "nope"}),
     "agents[0].tasks[1].steps[0].tool", "unknown tool 'nope'"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"][0].pop("tool"),
     "agents[0].tasks[0].steps[0].tool", "unknown tool None"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"][0].__setitem__("args", {}),
     "agents[0].tasks[0].steps[0].args", "text: required, a string"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"][0].__setitem__("args", "hi"),
     "agents[0].tasks[0].steps[0].args", "must be an object"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"][1].__setitem__("args", {"seconds": -1}),
     "agents[0].tasks[0].steps[1].args", "seconds: must be between 0 and 3600"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"][1].__setitem__("args", {"seconds": "soon"}),
     "agents[0].tasks[0].steps[1].args", "seconds: required, a number"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"][2].__setitem__("args", {"mode": "sometimes"}),
     "agents[0].tasks[0].steps[2].args", "mode: one of retryable, fatal"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"][2].__setitem__("args", {"times": -1}),
     "agents[0].tasks[0].steps[2].args", "times: a whole number, zero or more"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"].__setitem__(0, {"name": "h", "tool": "http_request",
                                                                   "args": {"url": "ftp://example.com"}}),
     "agents[0].tasks[0].steps[0].args", "url: must be an http(s) URL"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"][0].__setitem__("kind", "magic"),
     "agents[0].tasks[0].steps[0].kind", "must be one of approval, check, tool"),
    (lambda p: p["agents"][0]["tasks"][1]["steps"][0].pop("gate"),
     "agents[0].tasks[1].steps[0].gate", "required, a non-empty string"),
    (lambda p: p["agents"][0]["tasks"][1]["steps"].__setitem__(0, {"name": "c", "kind": "check", "check": "nope"}),
     "agents[0].tasks[1].steps[0].check", "unknown check 'nope'"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"][1].__setitem__("name", "hello"),
     "agents[0].tasks[0].steps[1].name", "duplicate step name 'hello'"),
    (lambda p: p["agents"][0]["tasks"][1].__setitem__("name", "fetch"),
     "agents[0].tasks[1].name", "duplicate task name 'fetch'"),
    (lambda p: p["agents"].append(copy.deepcopy(p["agents"][0])),
     "agents[1].name", "duplicate agent name 'research'"),
    (lambda p: p["agents"][0].__setitem__("name", "  "),
     "agents[0].name", "required, a non-empty string"),
    (lambda p: p["agents"][0]["tasks"][0].__setitem__("name", "x" * 201),
     "agents[0].tasks[0].name", "at most 200 characters"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"][0].pop("name"),
     "agents[0].tasks[0].steps[0].name", "required, a non-empty string"),
    (lambda p: p["agents"][0]["tasks"][1].__setitem__("depends_on", ["fetch", "missing"]),
     "agents[0].tasks[1].depends_on", "unknown task 'missing' in this agent"),
    (lambda p: p["agents"][0]["tasks"][1].__setitem__("depends_on", ["report"]),
     "agents[0].tasks[1].depends_on", "a task cannot depend on itself"),
    (lambda p: p["agents"][0]["tasks"][1].__setitem__("depends_on", "fetch"),
     "agents[0].tasks[1].depends_on", "must be a list of task names"),
    (lambda p: p["agents"][0]["tasks"][0].__setitem__("depends_on", ["report"]),
     "agents[0].tasks", "dependency cycle: fetch -> report -> fetch"),
    (lambda p: p["agents"][0].__setitem__("failure_mode", "yolo"),
     "agents[0].failure_mode", "must be one of continue, fail-fast, retry"),
    (lambda p: p["agents"][0].__setitem__("parallelism_mode", "random"),
     "agents[0].parallelism_mode", "must be one of dag, parallel, sequential"),
    (lambda p: p["agents"][0]["tasks"][0].__setitem__("failure_mode", "ignore"),
     "agents[0].tasks[0].failure_mode", "must be one of continue, fail-fast, retry"),
    (lambda p: p["agents"][0]["tasks"][0].__setitem__("parallelism_mode", "dag"),
     "agents[0].tasks[0].parallelism_mode", "must be one of parallel, sequential"),
    (lambda p: p.__setitem__("agents", []), "plan.agents", "required, a non-empty list"),
    (lambda p: p.pop("agents"), "plan.agents", "required, a non-empty list"),
    (lambda p: p["agents"][0].__setitem__("tasks", []), "agents[0].tasks", "required, a non-empty list"),
    (lambda p: p["agents"][0]["tasks"][0].__setitem__("steps", []),
     "agents[0].tasks[0].steps", "required, a non-empty list"),
    (lambda p: p["agents"].__setitem__(0, "research"), "agents[0]", "must be an object"),
    (lambda p: p["agents"][0]["tasks"].__setitem__(1, ["report"]), "agents[0].tasks[1]", "must be an object"),
    (lambda p: p["agents"][0]["tasks"][0]["steps"].__setitem__(0, "hello"),
     "agents[0].tasks[0].steps[0]", "must be an object"),
    (lambda p: p.__setitem__("max_agents", 0), "plan.max_agents", "must be a whole number from 1 to 100"),
    (lambda p: p.__setitem__("max_agents", 101), "plan.max_agents", "must be a whole number from 1 to 100"),
    (lambda p: p.__setitem__("max_agents", True), "plan.max_agents", "must be a whole number from 1 to 100"),
    (lambda p: p.__setitem__("max_agents", "ten"), "plan.max_agents", "must be a whole number from 1 to 100"),
]


@pytest.mark.parametrize(("change", "path", "message"), [
    pytest.param(change, path, message, id=f"{path}: {message}") for change, path, message in FIELD_ERRORS])
def test_field_level_errors_are_keyed_by_path(change, path, message):
    errors = errors_of(edited(change))
    assert path in errors, errors
    assert any(message in text for text in errors[path]), errors[path]


def test_a_self_dependency_is_also_reported_as_a_cycle():
    errors = errors_of(edited(lambda p: p["agents"][0]["tasks"][0].__setitem__("depends_on", ["fetch"])))
    assert errors["agents[0].tasks[0].depends_on"] == ["a task cannot depend on itself"]
    assert errors["agents[0].tasks"] == ["dependency cycle: fetch -> fetch"]


def test_a_longer_cycle_is_named_in_full():
    plan = make_plan(tasks=3, parallelism_mode="dag")
    tasks = plan["agents"][0]["tasks"]
    tasks[0]["depends_on"], tasks[1]["depends_on"], tasks[2]["depends_on"] = ["t2"], ["t0"], ["t1"]
    assert errors_of(plan) == {"agents[0].tasks": ["dependency cycle: t0 -> t2 -> t1 -> t0"]}


def test_depends_on_names_tasks_of_the_same_agent_only():
    plan = make_plan(agents=2, parallelism_mode="dag")
    plan["agents"][1]["tasks"][0]["name"] = "u0"
    plan["agents"][1]["tasks"][0]["depends_on"] = ["t0"]  # a task of agent a0, not of a1
    assert errors_of(plan) == {"agents[1].tasks[0].depends_on": ["unknown task 't0' in this agent"]}


def test_every_error_is_reported_at_once():
    plan = {"max_agents": 0, "agents": [
        {"name": "a", "failure_mode": "nope", "tasks": [
            {"name": "t", "steps": [{"name": "s", "tool": "nope"}, {"name": "s", "tool": "echo"}]},
        ]},
        {"name": "a", "tasks": []},
    ]}
    errors = errors_of(plan)
    unknown_tool = errors.pop("agents[0].tasks[0].steps[0].tool")
    assert len(unknown_tool) == 1
    assert unknown_tool[0].startswith("unknown tool 'nope'; registered: ")
    assert {"echo", "fail", "http_request", "sleep"} <= set(unknown_tool[0].split(": ", 1)[1].split(", "))
    assert errors == {
        "plan.max_agents": ["must be a whole number from 1 to 100"],
        "agents[0].failure_mode": ["must be one of continue, fail-fast, retry"],
        "agents[0].tasks[0].steps[1].name": ["duplicate step name 's'"],
        "agents[0].tasks[0].steps[1].args": ["text: required, a string"],
        "agents[1].name": ["duplicate agent name 'a'"],
        "agents[1].tasks": ["required, a non-empty list"],
    }


def _counts():
    return (Run.objects.count(), Event.objects.count(), AuditRecord.objects.count(), LedgerEntry.objects.count())


def test_run_create_with_a_bad_plan_writes_nothing(project, django_user_model):
    operator = django_user_model.objects.create_user(username="planner")
    plan = edited(lambda p: p["agents"][0]["tasks"][1]["steps"].__setitem__(0, {"name": "x", "tool": "nope"}))
    before = _counts()
    with pytest.raises(ValidationFailed) as raised:
        services.run_create(project=project, name="bad", plan=plan, actor=operator)
    assert set(raised.value.errors) == {"agents[0].tasks[1].steps[0].tool"}
    assert raised.value.status == 400
    assert _counts() == before


def test_run_create_reports_its_own_fields_with_the_plan_errors(project):
    before = _counts()
    with pytest.raises(ValidationFailed) as raised:
        services.run_create(project=project, name=" ", plan={"agents": []}, priority=5000, failure_mode="maybe",
                            max_attempts=0, credit_limit=-3)
    assert raised.value.errors == {
        "name": ["required, a non-empty string"],
        "priority": ["a whole number from -1000 to 1000"],
        "failure_mode": ["one of fail-fast, continue, retry"],
        "max_attempts": ["a whole number from 1 to 10"],
        "credit_limit": ["a whole number greater than zero"],
        "plan.agents": ["required, a non-empty list"],
    }
    assert _counts() == before


@pytest.mark.parametrize("bad", [None, "x" * 201, 7])
def test_run_create_refuses_a_bad_name(project, bad):
    with pytest.raises(ValidationFailed) as raised:
        services.run_create(project=project, name=bad, plan=make_plan())
    assert list(raised.value.errors) == ["name"]
    assert not Run.objects.exists()


def test_run_create_refuses_a_non_object_plan(project):
    with pytest.raises(ValidationFailed) as raised:
        services.run_create(project=project, name="list plan", plan=[make_plan()])
    assert raised.value.errors == {"plan": ["must be a JSON object"]}
    assert not Run.objects.exists()


# --- size caps and the cost of one try ----------------------------------------------------------

def chain_plan(length: int) -> dict:
    """One agent whose tasks form a chain: t1 depends on t0, t2 on t1, ..."""
    plan = make_plan(tasks=length, parallelism_mode="dag")
    for index, task in enumerate(plan["agents"][0]["tasks"][1:], start=1):
        task["depends_on"] = [f"t{index - 1}"]
    return plan


def test_a_dependency_chain_of_5000_tasks_is_checked_without_recursion(settings):
    settings.ORCHESTRATOR_PLAN_MAX_TASKS_PER_AGENT = 5000
    plan = chain_plan(5000)
    assert plan_validate(plan) is plan
    plan["agents"][0]["tasks"][0]["depends_on"] = ["t4999"]  # closes the chain into a cycle
    cycle = errors_of(plan)["agents[0].tasks"][0]
    assert cycle.startswith("dependency cycle: t0 -> t4999 -> t4998 -> ")
    assert cycle.endswith(" -> t1 -> t0") and cycle.count(" -> ") == 5000


def test_a_chain_at_the_default_cap_is_valid():
    plan = chain_plan(200)
    assert plan_validate(plan) is plan


@pytest.mark.parametrize("plan, path, message", [
    (make_plan(agents=51), "plan.agents",
     "at most 50 agents in a plan (ORCHESTRATOR_PLAN_MAX_AGENTS); this one has 51"),
    (make_plan(tasks=201), "agents[0].tasks",
     "at most 200 tasks in an agent (ORCHESTRATOR_PLAN_MAX_TASKS_PER_AGENT); this one has 201"),
    (make_plan(steps=101), "agents[0].tasks[0].steps",
     "at most 100 steps in a task (ORCHESTRATOR_PLAN_MAX_STEPS_PER_TASK); this one has 101"),
    (make_plan(agents=26, tasks=2, steps=97), "plan.agents",
     "at most 5000 steps in a plan (ORCHESTRATOR_PLAN_MAX_STEPS); this one has 5044"),
], ids=["agents", "tasks_per_agent", "steps_per_task", "steps"])
def test_a_plan_over_a_size_cap_is_refused_naming_the_cap_and_writes_nothing(project, plan, path, message):
    assert path in errors_of(plan)
    before = _counts()
    with pytest.raises(ValidationFailed) as raised:
        services.run_create(project=project, name="too large", plan=plan)
    assert raised.value.errors == {path: [message]}
    assert _counts() == before


def test_the_size_caps_come_from_the_settings(settings, project):
    settings.ORCHESTRATOR_PLAN_MAX_AGENTS = 2
    settings.ORCHESTRATOR_PLAN_MAX_TASKS_PER_AGENT = 2
    settings.ORCHESTRATOR_PLAN_MAX_STEPS_PER_TASK = 2
    settings.ORCHESTRATOR_PLAN_MAX_STEPS = 7
    assert plan_validate(make_plan(agents=2, tasks=2, steps=1))
    assert list(errors_of(make_plan(agents=3))) == ["plan.agents"]
    assert list(errors_of(make_plan(tasks=3))) == ["agents[0].tasks"]
    assert list(errors_of(make_plan(steps=3))) == ["agents[0].tasks[0].steps"]
    assert errors_of(make_plan(agents=2, tasks=2, steps=2)) == {
        "plan.agents": ["at most 7 steps in a plan (ORCHESTRATOR_PLAN_MAX_STEPS); this one has 8"]}
    settings.ORCHESTRATOR_PLAN_MAX_STEPS = 8
    assert services.run_create(project=project, name="at the caps", plan=make_plan(agents=2, tasks=2, steps=2))


def test_a_credit_limit_below_one_try_of_each_step_is_refused_naming_the_minimum(project):
    plan = copy.deepcopy(DESIGN_PLAN)  # echo 1 + sleep 1 + fail 1; the approval costs nothing
    plan["agents"][0]["tasks"][1]["steps"].append({"name": "call", "tool": "http_request",
                                                   "args": {"url": "http://127.0.0.1/", "method": "GET"}})
    assert plan_cost_estimate(plan, tries_per_step=1) == 5
    before = _counts()
    with pytest.raises(ValidationFailed) as raised:
        services.run_create(project=project, name="too tight", plan=copy.deepcopy(plan), credit_limit=4)
    assert raised.value.errors == {
        "credit_limit": ["at least 5: one try of each step of the plan costs 5 credits"]}
    assert _counts() == before
    run = services.run_create(project=project, name="just enough", plan=copy.deepcopy(plan), credit_limit=5)
    assert run.credit_limit == 5
    # A dry run charges nothing: any limit will do.
    assert services.run_create(project=project, name="dry", plan=copy.deepcopy(plan), credit_limit=1,
                               mode="dryrun").credit_limit == 1
