"""The plan format (DESIGN §2.2) and its validation with field-level errors."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from core.errors import ValidationFailed
from runs.models import FailureMode, ParallelismMode, Step
from runs.tools import tool_get, tool_names

FAILURE_MODES = {choice.value for choice in FailureMode}
AGENT_TASK_MODES = {choice.value for choice in ParallelismMode}
STEP_MODES = {ParallelismMode.SEQUENTIAL.value, ParallelismMode.PARALLEL.value}
STEP_KINDS = {choice.value for choice in Step.Kind}
MAX_NAME_LENGTH = 200

# Registered internal checks (``check`` steps); gated pipelines register theirs here.
CHECKS: dict[str, Any] = {}


def _name_errors(value: Any) -> list[str]:
    if not isinstance(value, str) or not value.strip():
        return ["required, a non-empty string"]
    if len(value) > MAX_NAME_LENGTH:
        return [f"at most {MAX_NAME_LENGTH} characters"]
    return []


def _check_mode(node: dict, key: str, allowed: set[str], path: str, errors: dict[str, list[str]]) -> None:
    if key in node and (not isinstance(node[key], str) or node[key] not in allowed):
        errors.setdefault(f"{path}.{key}", []).append(f"must be one of {', '.join(sorted(allowed))}")


def _dag_cycle(tasks: list[dict]) -> list[str] | None:
    graph = {t["name"]: [d for d in t.get("depends_on") or [] if isinstance(d, str)]
             if isinstance(t.get("depends_on") or [], list) else []
             for t in tasks if isinstance(t.get("name"), str)}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in graph.get(node, []):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if state.get(dep) is None:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for name in graph:
        if state.get(name) is None:
            found = visit(name)
            if found:
                return found
    return None


def plan_validate(plan: Any) -> dict:
    """Return the plan when valid; raise ``ValidationFailed`` with every field error otherwise."""
    errors: dict[str, list[str]] = {}

    def add(path: str, message: str) -> None:
        errors.setdefault(path, []).append(message)

    if not isinstance(plan, dict):
        raise ValidationFailed("invalid plan", errors={"plan": ["must be a JSON object"]})
    max_agents = plan.get("max_agents", settings.ORCHESTRATOR_MAX_AGENTS)
    if isinstance(max_agents, bool) or not isinstance(max_agents, int) or not 1 <= max_agents <= 100:
        add("plan.max_agents", "must be a whole number from 1 to 100")
    agents = plan.get("agents")
    if not isinstance(agents, list) or not agents:
        add("plan.agents", "required, a non-empty list")
        agents = []
    if "pins" in plan and not isinstance(plan["pins"], dict):
        add("plan.pins", "must be an object")
    agent_names: set[str] = set()
    for a_index, agent in enumerate(agents):
        a_path = f"agents[{a_index}]"
        if not isinstance(agent, dict):
            add(a_path, "must be an object")
            continue
        for message in _name_errors(agent.get("name")):
            add(f"{a_path}.name", message)
        if isinstance(agent.get("name"), str):
            if agent["name"] in agent_names:
                add(f"{a_path}.name", f"duplicate agent name {agent['name']!r}")
            agent_names.add(agent["name"])
        _check_mode(agent, "failure_mode", FAILURE_MODES, a_path, errors)
        _check_mode(agent, "parallelism_mode", AGENT_TASK_MODES, a_path, errors)
        tasks = agent.get("tasks")
        if not isinstance(tasks, list) or not tasks:
            add(f"{a_path}.tasks", "required, a non-empty list")
            continue
        task_names: set[str] = set()
        for t_index, task in enumerate(tasks):
            t_path = f"{a_path}.tasks[{t_index}]"
            if not isinstance(task, dict):
                add(t_path, "must be an object")
                continue
            for message in _name_errors(task.get("name")):
                add(f"{t_path}.name", message)
            if isinstance(task.get("name"), str):
                if task["name"] in task_names:
                    add(f"{t_path}.name", f"duplicate task name {task['name']!r}")
                task_names.add(task["name"])
            _check_mode(task, "failure_mode", FAILURE_MODES, t_path, errors)
            _check_mode(task, "parallelism_mode", STEP_MODES, t_path, errors)
            steps = task.get("steps")
            if not isinstance(steps, list) or not steps:
                add(f"{t_path}.steps", "required, a non-empty list")
                continue
            step_names: set[str] = set()
            for s_index, step in enumerate(steps):
                s_path = f"{t_path}.steps[{s_index}]"
                if not isinstance(step, dict):
                    add(s_path, "must be an object")
                    continue
                for message in _name_errors(step.get("name")):
                    add(f"{s_path}.name", message)
                if isinstance(step.get("name"), str):
                    if step["name"] in step_names:
                        add(f"{s_path}.name", f"duplicate step name {step['name']!r}")
                    step_names.add(step["name"])
                kind = step.get("kind", "tool")
                if not isinstance(kind, str) or kind not in STEP_KINDS:
                    add(f"{s_path}.kind", f"must be one of {', '.join(sorted(STEP_KINDS))}")
                    continue
                args = step.get("args", {})
                if not isinstance(args, dict):
                    add(f"{s_path}.args", "must be an object")
                    args = {}
                if kind == "tool":
                    tool = tool_get(step.get("tool")) if isinstance(step.get("tool"), str) else None
                    if tool is None:
                        add(f"{s_path}.tool", f"unknown tool {step.get('tool')!r}; registered: {', '.join(tool_names())}")
                    else:
                        for message in tool.validate(args):
                            add(f"{s_path}.args", message)
                elif kind == "check":
                    if not isinstance(step.get("check"), str) or step["check"] not in CHECKS:
                        known = ", ".join(sorted(CHECKS)) or "none"
                        add(f"{s_path}.check", f"unknown check {step.get('check')!r}; registered: {known}")
                elif kind == "approval":
                    for message in _name_errors(step.get("gate")):
                        add(f"{s_path}.gate", message)
        if agent.get("parallelism_mode") == "dag" or any(
            isinstance(t, dict) and t.get("depends_on") for t in tasks
        ):
            for t_index, task in enumerate(tasks):
                if not isinstance(task, dict):
                    continue
                deps = task.get("depends_on", [])
                if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
                    add(f"{a_path}.tasks[{t_index}].depends_on", "must be a list of task names")
                    continue
                for dep in deps:
                    if dep not in task_names:
                        add(f"{a_path}.tasks[{t_index}].depends_on", f"unknown task {dep!r} in this agent")
                    elif dep == task.get("name"):
                        add(f"{a_path}.tasks[{t_index}].depends_on", "a task cannot depend on itself")
            cycle = _dag_cycle([t for t in tasks if isinstance(t, dict)])
            if cycle:
                add(f"{a_path}.tasks", f"dependency cycle: {' -> '.join(cycle)}")
    if errors:
        raise ValidationFailed("invalid plan", errors=errors)
    return plan


def plan_cost_estimate(plan: dict, *, tries_per_step: int = 3) -> int:
    """Credits a plan may consume if every step uses all its tries (the default credit limit)."""
    total = 0
    for agent in plan.get("agents", []):
        for task in agent.get("tasks", []):
            for step in task.get("steps", []):
                kind = step.get("kind", "tool")
                if kind == "tool":
                    tool = tool_get(step["tool"])
                    total += tool.cost * tries_per_step if tool else 0
    return max(total, 1)
