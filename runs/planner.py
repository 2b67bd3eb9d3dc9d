"""Re-plan (seed 001 §6.4): when more than half the agents failed, or more than 10 tasks,
a planner may produce a new decomposition of the failed work instead of failing the run.

A planner takes the run and its failed agents and returns new agent specs (plan format) or
an empty list when it cannot help. The built-in planner re-decomposes each failed agent's
unfinished tasks into one agent per task, each task retried on its own; it declines when a
failure was not retryable (a new plan would repeat the same fatal call).
"""

from __future__ import annotations

from typing import Protocol

from runs.models import Agent, NodeStatus, Run, Step, StepAttempt, Task

MAX_REPLANS = 1
FAILED_AGENT_SHARE = 0.5
FAILED_TASK_LIMIT = 10


class Planner(Protocol):
    def replan(self, run: Run, failed_agents: list[Agent]) -> list[dict]: ...


def replan_needed(run: Run) -> bool:
    agents = Agent.objects.filter(run=run, attempt_number=run.attempt_number)
    total = agents.count()
    failed = agents.filter(status=NodeStatus.FAILED).count()
    failed_tasks = Task.objects.filter(agent__in=agents, status=NodeStatus.FAILED).count()
    return (total > 0 and failed > total * FAILED_AGENT_SHARE) or failed_tasks > FAILED_TASK_LIMIT


class SplitFailedWorkPlanner:
    """One new agent per unfinished task of each failed agent, when every failure was retryable."""

    def replan(self, run: Run, failed_agents: list[Agent]) -> list[dict]:
        fatal = StepAttempt.objects.filter(step__task__agent__in=failed_agents, outcome=StepAttempt.Outcome.FAILED,
                                           retryable=False).exists()
        if fatal:
            return []
        specs = []
        taken = set(Agent.objects.filter(run=run, attempt_number=run.attempt_number).values_list("name", flat=True))
        for agent in failed_agents:
            for task in Task.objects.filter(agent=agent).exclude(status=NodeStatus.COMPLETED).order_by("sequence"):
                name = f"{agent.name}/{task.name}~replan{run.replan_count + 1}"
                if name in taken:
                    continue
                steps = [{"name": step.name, "kind": step.kind, "tool": step.tool,
                          "args": {k: v for k, v in step.args.items() if k not in ("gate", "check")}}
                         for step in Step.objects.filter(task=task).order_by("sequence")]
                specs.append({"name": name, "failure_mode": "fail-fast", "parallelism_mode": "sequential",
                              "tasks": [{"name": task.name, "failure_mode": "retry",
                                         "parallelism_mode": task.parallelism_mode, "steps": steps}]})
        return specs


PLANNER: Planner = SplitFailedWorkPlanner()
