"""The plan format (DESIGN §2.2 and §4) and its validation with field-level errors.

Gated pipelines add to the plan: ``check`` steps (a registered check with its arguments),
``approval`` steps, ``pins`` (at the top, and on tool steps that produce them), ``caps``
(``run_hard_cap_minutes``, ``phase_soft_cap_minutes`` by phase, ``default_phase_soft_cap_minutes``)
and, on tasks (a pipeline's phases), ``soft_cap_minutes`` and ``idempotency_key``. In a gated
plan, phase (task) names and gate names are unique across the whole plan.

A plan's size is capped (``ORCHESTRATOR_PLAN_MAX_AGENTS``, ``..._MAX_TASKS_PER_AGENT``,
``..._MAX_STEPS_PER_TASK``, ``..._MAX_STEPS``): a plan over a cap is refused before the rest of
it is looked at, with an error naming the cap.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.conf import settings

from core.errors import ValidationFailed
from core.validation import text_errors
from runs.models import FailureMode, ParallelismMode, Step
from runs.pipeline.checks import CHECKS
from runs.pipeline.pins import pins_spec_errors
from jobs.tools import tool_get, tool_names

FAILURE_MODES = {choice.value for choice in FailureMode}
AGENT_TASK_MODES = {choice.value for choice in ParallelismMode}
STEP_MODES = {ParallelismMode.SEQUENTIAL.value, ParallelismMode.PARALLEL.value}
STEP_KINDS = {choice.value for choice in Step.Kind}
MAX_NAME_LENGTH = 200
MAX_CAP_MINUTES = 7 * 24 * 60
PIPELINE_KEY_MAX_LENGTH = 250

__all__ = ["CHECKS", "plan_validate", "plan_cost_estimate", "plan_diff", "plan_is_gated", "plan_task_spec", "plan_step_spec"]


def plan_is_gated(plan: Any) -> bool:
    """A gated pipeline: the plan declares pins or caps, or has a check or approval step."""
    if not isinstance(plan, dict):
        return False
    if plan.get("pins") or plan.get("caps"):
        return True
    return any(isinstance(step, dict) and step.get("kind") in ("check", "approval")
               for agent in plan.get("agents") or [] if isinstance(agent, dict)
               for task in agent.get("tasks") or [] if isinstance(task, dict)
               for step in task.get("steps") or [])


def plan_task_spec(plan: dict, agent_name: str, task_name: str) -> dict:
    """The plan's spec of a task ({} when the task is not in the plan, e.g. added by a re-plan)."""
    for agent in (plan or {}).get("agents") or []:
        if agent.get("name") == agent_name:
            for task in agent.get("tasks") or []:
                if task.get("name") == task_name:
                    return task
    return {}


def plan_step_spec(plan: dict, agent_name: str, task_name: str, step_name: str) -> dict:
    for step in plan_task_spec(plan, agent_name, task_name).get("steps") or []:
        if step.get("name") == step_name:
            return step
    return {}


def _minutes_errors(value: Any) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_CAP_MINUTES:
        return [f"minutes, more than 0 and at most {MAX_CAP_MINUTES}"]
    return []


def _caps_errors(caps: Any) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    if not isinstance(caps, dict):
        return {"plan.caps": ["must be an object"]}
    known = {"run_hard_cap_minutes", "phase_soft_cap_minutes", "default_phase_soft_cap_minutes"}
    for key in caps:
        if key not in known:
            errors.setdefault(f"plan.caps.{key}", []).append(f"unknown cap; known: {', '.join(sorted(known))}")
    for key in ("run_hard_cap_minutes", "default_phase_soft_cap_minutes"):
        if key in caps and caps[key] is not None:
            for message in _minutes_errors(caps[key]):
                errors.setdefault(f"plan.caps.{key}", []).append(message)
    phases = caps.get("phase_soft_cap_minutes", {})
    if not isinstance(phases, dict):
        errors.setdefault("plan.caps.phase_soft_cap_minutes", []).append("must be an object: phase → minutes")
    else:
        for phase, minutes in phases.items():
            for message in _minutes_errors(minutes):
                errors.setdefault(f"plan.caps.phase_soft_cap_minutes.{phase}", []).append(message)
    return errors


def _check_mode(node: dict, key: str, allowed: set[str], path: str, errors: dict[str, list[str]]) -> None:
    if key in node and (not isinstance(node[key], str) or node[key] not in allowed):
        errors.setdefault(f"{path}.{key}", []).append(f"must be one of {', '.join(sorted(allowed))}")


def _dag_cycle(tasks: list[dict]) -> list[str] | None:
    """A dependency cycle among ``tasks`` (``[a, b, a]``), or None. Iterative: a chain of thousands
    of tasks must not exhaust Python's stack."""
    graph = {t["name"]: [d for d in t.get("depends_on") or [] if isinstance(d, str)]
             if isinstance(t.get("depends_on") or [], list) else []
             for t in tasks if isinstance(t.get("name"), str)}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in graph:
        if root in state:
            continue
        state[root] = 1
        path = [root]
        pending = [iter(graph[root])]
        while pending:
            for dep in pending[-1]:
                if dep not in graph:
                    continue
                if state.get(dep) == 1:
                    return path[path.index(dep):] + [dep]
                if dep not in state:
                    state[dep] = 1
                    path.append(dep)
                    pending.append(iter(graph[dep]))
                    break
            else:
                state[path.pop()] = 2
                pending.pop()
    return None


def _size_errors(plan: dict) -> dict[str, list[str]]:
    """The plan's size against the caps (``ORCHESTRATOR_PLAN_MAX_*``), counted before anything else."""
    errors: dict[str, list[str]] = {}
    agents = plan.get("agents")
    if not isinstance(agents, list):
        return errors
    max_agents = settings.ORCHESTRATOR_PLAN_MAX_AGENTS
    max_tasks = settings.ORCHESTRATOR_PLAN_MAX_TASKS_PER_AGENT
    max_steps_per_task = settings.ORCHESTRATOR_PLAN_MAX_STEPS_PER_TASK
    max_steps = settings.ORCHESTRATOR_PLAN_MAX_STEPS
    if len(agents) > max_agents:
        errors["plan.agents"] = [f"at most {max_agents} agents in a plan (ORCHESTRATOR_PLAN_MAX_AGENTS); "
                                 f"this one has {len(agents)}"]
        return errors  # the rest is not worth counting
    total = 0
    for a_index, agent in enumerate(agents):
        tasks = agent.get("tasks") if isinstance(agent, dict) else None
        if not isinstance(tasks, list):
            continue
        if len(tasks) > max_tasks:
            errors[f"agents[{a_index}].tasks"] = [f"at most {max_tasks} tasks in an agent "
                                                  f"(ORCHESTRATOR_PLAN_MAX_TASKS_PER_AGENT); this one has {len(tasks)}"]
            continue
        for t_index, task in enumerate(tasks):
            steps = task.get("steps") if isinstance(task, dict) else None
            if not isinstance(steps, list):
                continue
            total += len(steps)
            if len(steps) > max_steps_per_task:
                errors[f"agents[{a_index}].tasks[{t_index}].steps"] = [
                    f"at most {max_steps_per_task} steps in a task (ORCHESTRATOR_PLAN_MAX_STEPS_PER_TASK); "
                    f"this one has {len(steps)}"]
    if total > max_steps:
        errors["plan.agents"] = [f"at most {max_steps} steps in a plan (ORCHESTRATOR_PLAN_MAX_STEPS); "
                                 f"this one has {total}"]
    return errors


def _node_ok(node: Any, path: str, level: str, seen: set[str], add) -> bool:
    """The checks every level of a plan shares: an object, with a valid name unique among its
    siblings (``seen``). False when it is no object (nothing more can be checked under it)."""
    if not isinstance(node, dict):
        add(path, "must be an object")
        return False
    for message in text_errors(node.get("name"), max_length=MAX_NAME_LENGTH):
        add(f"{path}.name", message)
    if isinstance(node.get("name"), str):
        if node["name"] in seen:
            add(f"{path}.name", f"duplicate {level} name {node['name']!r}")
        seen.add(node["name"])
    return True


def _children(children: Any, path: str, level: str, names: set[str], add) -> Iterator[tuple[dict, str]]:
    """The nodes of a required, non-empty list at ``path`` (an agent's tasks, a task's steps) that
    pass the checks every level shares, each with its own path; ``names`` collects their names."""
    if not isinstance(children, list) or not children:
        add(path, "required, a non-empty list")
        return
    for index, child in enumerate(children):
        child_path = f"{path}[{index}]"
        if _node_ok(child, child_path, level, names, add):
            yield child, child_path


def plan_validate(plan: Any) -> dict:
    """Return the plan when valid; raise ``ValidationFailed`` with every field error otherwise."""
    errors: dict[str, list[str]] = {}

    def add(path: str, message: str) -> None:
        errors.setdefault(path, []).append(message)

    if not isinstance(plan, dict):
        raise ValidationFailed("invalid plan", errors={"plan": ["must be a JSON object"]})
    too_large = _size_errors(plan)
    if too_large:
        raise ValidationFailed("plan too large", errors=too_large)
    max_agents = plan.get("max_agents", settings.ORCHESTRATOR_MAX_AGENTS)
    if isinstance(max_agents, bool) or not isinstance(max_agents, int) or not 1 <= max_agents <= 100:
        add("plan.max_agents", "must be a whole number from 1 to 100")
    agents = plan.get("agents")
    if not isinstance(agents, list) or not agents:
        add("plan.agents", "required, a non-empty list")
        agents = []
    if "pins" in plan:
        for path, messages in pins_spec_errors(plan["pins"], "plan.pins").items():
            errors.setdefault(path, []).extend(messages)
    if "caps" in plan:
        for path, messages in _caps_errors(plan["caps"]).items():
            errors.setdefault(path, []).extend(messages)
    gated = plan_is_gated(plan)
    phase_names: set[str] = set()
    gate_names: set[str] = set()
    pipeline_keys: set[str] = set()
    pin_dimensions: set[str] = set(plan["pins"]) if isinstance(plan.get("pins"), dict) else set()
    agent_names: set[str] = set()
    for a_index, agent in enumerate(agents):
        a_path = f"agents[{a_index}]"
        if not _node_ok(agent, a_path, "agent", agent_names, add):
            continue
        _check_mode(agent, "failure_mode", FAILURE_MODES, a_path, errors)
        _check_mode(agent, "parallelism_mode", AGENT_TASK_MODES, a_path, errors)
        tasks = agent.get("tasks")
        task_names: set[str] = set()
        for task, t_path in _children(tasks, f"{a_path}.tasks", "task", task_names, add):
            _check_mode(task, "failure_mode", FAILURE_MODES, t_path, errors)
            _check_mode(task, "parallelism_mode", STEP_MODES, t_path, errors)
            if gated and isinstance(task.get("name"), str):
                if task["name"] in phase_names:
                    add(f"{t_path}.name", f"phase {task['name']!r} is named twice: in a gated pipeline task "
                                          "names are unique across agents")
                phase_names.add(task["name"])
            if "soft_cap_minutes" in task:
                for message in _minutes_errors(task["soft_cap_minutes"]):
                    add(f"{t_path}.soft_cap_minutes", message)
            if "idempotency_key" in task:
                key = task["idempotency_key"]
                if not isinstance(key, str) or not key.strip() or len(key) > PIPELINE_KEY_MAX_LENGTH:
                    add(f"{t_path}.idempotency_key", f"a non-empty string of at most {PIPELINE_KEY_MAX_LENGTH} "
                                                     "characters")
                elif key in pipeline_keys:
                    add(f"{t_path}.idempotency_key", f"key {key!r} is used by another phase of this plan")
                else:
                    pipeline_keys.add(key)
            for step, s_path in _children(task.get("steps"), f"{t_path}.steps", "step", set(), add):
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
                    if "pins" in step:
                        for path, messages in pins_spec_errors(step["pins"], f"{s_path}.pins").items():
                            errors.setdefault(path, []).extend(messages)
                        for dimension in step["pins"] if isinstance(step["pins"], dict) else []:
                            if dimension in pin_dimensions:
                                add(f"{s_path}.pins.{dimension}", f"pin {dimension!r} is declared twice in this plan")
                            pin_dimensions.add(dimension)
                elif "pins" in step:
                    add(f"{s_path}.pins", "only tool steps produce pins")
                gate_name = None
                if kind == "check":
                    check = CHECKS.get(step["check"]) if isinstance(step.get("check"), str) else None
                    if check is None:
                        known = ", ".join(sorted(CHECKS)) or "none"
                        add(f"{s_path}.check", f"unknown check {step.get('check')!r}; registered: {known}")
                    else:
                        for message in check.validate(args):
                            add(f"{s_path}.args", message)
                    if "gate" in step:
                        for message in text_errors(step.get("gate"), max_length=MAX_NAME_LENGTH):
                            add(f"{s_path}.gate", message)
                    gate_name = step.get("gate", step.get("name"))
                elif kind == "approval":
                    for message in text_errors(step.get("gate"), max_length=MAX_NAME_LENGTH):
                        add(f"{s_path}.gate", message)
                    gate_name = step.get("gate")
                if isinstance(gate_name, str):
                    if gate_name in gate_names:
                        add(f"{s_path}.gate", f"gate {gate_name!r} is named twice: gate names are unique in a plan")
                    gate_names.add(gate_name)
        if not isinstance(tasks, list) or not tasks:
            continue
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


def plan_cost_estimate(plan: dict, *, tries_per_step: int = 3, level_retries: int = 0) -> int:
    """Credits a plan may consume if every step uses all its tries (the default credit limit);
    with ``tries_per_step=1``, what one try of each step costs (the least credit limit). With
    ``level_retries``, a task or agent whose failure mode is ``retry`` may run its steps that many
    times more (the worst case of a re-plan, whose tasks retry)."""
    total = 0
    for agent in plan.get("agents", []):
        agent_runs = 1 + (level_retries if agent.get("failure_mode") == FailureMode.RETRY else 0)
        for task in agent.get("tasks", []):
            task_runs = agent_runs * (1 + (level_retries if task.get("failure_mode") == FailureMode.RETRY else 0))
            for step in task.get("steps", []):
                kind = step.get("kind", "tool")
                if kind == "tool":
                    tool = tool_get(step["tool"])
                    total += tool.cost * tries_per_step * task_runs if tool else 0
    return max(total, 1)


def plan_diff(before: Any, after: Any, path: str = "") -> list[str]:
    """The paths where two plans differ, each with its old and new value (``agents[0].tasks[0]
    .steps[1].args.mode: 'fatal' → 'retryable'``): a compact record of an edit."""
    if isinstance(before, dict) and isinstance(after, dict):
        changes = []
        for key in [*before, *(k for k in after if k not in before)]:
            changes += plan_diff(before.get(key, _MISSING), after.get(key, _MISSING), f"{path}.{key}" if path else key)
        return changes
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [change for n, (old, new) in enumerate(zip(before, after)) for change in plan_diff(old, new, f"{path}[{n}]")]
    if before == after:
        return []
    return [f"{path or '(plan)'}: {_shown(before)} → {_shown(after)}"]


_MISSING = object()


def _shown(value: Any) -> str:
    text = "(none)" if value is _MISSING else repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
