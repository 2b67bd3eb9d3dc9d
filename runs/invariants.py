"""The invariant checker (seed 001 §2): credits, hierarchy, state consistency, ledger integrity.

Reads only. Each violation names the ids involved. Queries are grouped, so a check costs a
fixed number of queries whatever the number of runs.
"""

from __future__ import annotations

import hmac
from collections import defaultdict
from dataclasses import dataclass

from django.db.models import Count, F, Sum

from billing.chain import chain_key, legacy_seal
from billing.models import CreditAccount, LedgerEntry
from billing.selectors import ledger_account_sums
from runs.models import (
    LIVE_NODE_STATES,
    NOT_STARTED_RUN_STATES,
    Agent,
    Artifact,
    NodeStatus,
    Run,
    RunAttempt,
    Step,
    Task,
)


@dataclass(frozen=True)
class Violation:
    check: str
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.message}"


def _ledger_by_attempt() -> dict[tuple[int, int], dict[str, int]]:
    totals: dict[tuple[int, int], dict[str, int]] = defaultdict(lambda: {"reserved": 0, "charged": 0, "refunded": 0})
    rows = (LedgerEntry.objects.filter(run__isnull=False).values("run_id", "attempt_number", "kind", "source")
            .annotate(total=Sum("amount")).order_by())
    for row in rows:
        bucket = totals[(row["run_id"], row["attempt_number"])]
        if row["kind"] == LedgerEntry.Kind.RESERVE:
            bucket["reserved"] += row["total"]
        elif row["kind"] == LedgerEntry.Kind.CHARGE:
            bucket["charged"] += row["total"]
        elif row["kind"] == LedgerEntry.Kind.REFUND:
            bucket["refunded"] += row["total"]
            if row["source"] == LedgerEntry.Source.CHARGE:
                bucket["charged"] -= row["total"]
    return totals


def check_credits() -> list[Violation]:
    violations: list[Violation] = []
    ledger = _ledger_by_attempt()
    runs = {r["id"]: r for r in Run.objects.values("id", "status", "attempt_number", "credits_reserved",
                                                   "credits_charged", "credits_refunded")}
    run_sums: dict[int, dict[str, int]] = defaultdict(lambda: {"reserved": 0, "charged": 0, "refunded": 0})
    seen: set[tuple[int, int]] = set()
    for attempt in RunAttempt.objects.values("run_id", "number", "credits_reserved", "credits_charged",
                                             "credits_refunded", "outcome").iterator():
        key = (attempt["run_id"], attempt["number"])
        seen.add(key)
        entry = ledger.get(key, {"reserved": 0, "charged": 0, "refunded": 0})
        counters = {"reserved": attempt["credits_reserved"], "charged": attempt["credits_charged"],
                    "refunded": attempt["credits_refunded"]}
        where = f"run {key[0]} attempt {key[1]}"
        if counters != entry:
            violations.append(Violation("credits", f"{where}: counters {counters} differ from the ledger {entry}"))
        if not entry["reserved"] >= entry["charged"] >= 0:
            violations.append(Violation("credits", f"{where}: reserved {entry['reserved']} >= charged "
                                                   f"{entry['charged']} >= 0 does not hold"))
        run = runs.get(key[0])
        settled = attempt["outcome"] != "" or (run is not None and run["attempt_number"] != key[1])
        if settled and entry["charged"] + entry["refunded"] != entry["reserved"]:
            violations.append(Violation("credits", f"{where} is settled but charged {entry['charged']} + refunded "
                                                   f"{entry['refunded']} != reserved {entry['reserved']}"))
        if not settled and entry["charged"] + entry["refunded"] > entry["reserved"]:
            violations.append(Violation("credits", f"{where}: more charged and refunded than reserved"))
        for name in ("reserved", "charged", "refunded"):
            run_sums[key[0]][name] += counters[name]
    for key in ledger:
        if key not in seen:
            violations.append(Violation("credits", f"ledger entries for run {key[0]} attempt {key[1]} "
                                                   f"which has no attempt record"))
    for run_id, run in runs.items():
        counters = {"reserved": run["credits_reserved"], "charged": run["credits_charged"],
                    "refunded": run["credits_refunded"]}
        if counters != run_sums.get(run_id, {"reserved": 0, "charged": 0, "refunded": 0}):
            violations.append(Violation("credits", f"run {run_id}: totals {counters} differ from its attempts "
                                                   f"{dict(run_sums.get(run_id, {}))}"))
    for account in CreditAccount.objects.all():
        sums = ledger_account_sums(organization_id=account.organization_id)
        if sums["balance"] != account.balance or sums["reserved"] != account.reserved:
            violations.append(Violation("credits", f"organization {account.organization_id}: account balance "
                                                   f"{account.balance}/reserved {account.reserved} differ from "
                                                   f"the ledger {sums['balance']}/{sums['reserved']}"))
        if account.balance < account.reserved:
            violations.append(Violation("credits", f"organization {account.organization_id}: negative available"))
    return violations


def check_ledger_integrity() -> list[Violation]:
    """Every entry's keyed hash matches its content and chains to the previous one of its
    organization; entries hashed before the chain was keyed end where their seal says."""
    violations: list[Violation] = []
    key = chain_key()
    accounts = {account.organization_id: account for account in CreditAccount.objects.all()}
    legacy_end = {org: account.legacy_chain_end for org, account in accounts.items()
                  if account.legacy_chain_end is not None}
    legacy_last: dict[int, tuple[int, str]] = {}
    last_hash: dict[int, str] = defaultdict(str)
    for entry in LedgerEntry.objects.order_by("id").iterator(chunk_size=2000):
        organization_id = entry.organization_id
        if entry.amount <= 0:
            violations.append(Violation("ledger", f"entry {entry.pk}: amount {entry.amount} is not positive"))
        if entry.prev_hash != last_hash[organization_id]:
            violations.append(Violation("ledger", f"entry {entry.pk}: chain broken (an entry before it of "
                                                  f"organization {organization_id} changed or vanished)"))
        legacy = organization_id in legacy_end and entry.pk <= legacy_end[organization_id]
        expected = entry.compute_legacy_hash() if legacy else entry.compute_hash(key=key)
        if not hmac.compare_digest(expected, entry.entry_hash):
            violations.append(Violation("ledger", f"entry {entry.pk}: content changed after it was written"))
        if legacy:
            legacy_last[organization_id] = (entry.pk, entry.entry_hash)
        last_hash[organization_id] = entry.entry_hash
    for organization_id, account in accounts.items():
        if account.last_entry_hash != last_hash[organization_id]:
            violations.append(Violation("ledger", f"organization {organization_id}: its newest entry "
                                                  f"is not the one the account last wrote"))
        if organization_id in legacy_end:
            end_id, end_hash = legacy_last.get(organization_id, (None, ""))
            seal = legacy_seal(organization_id=organization_id, entry_id=legacy_end[organization_id],
                               entry_hash=end_hash, key=key)
            if end_id != legacy_end[organization_id] or not hmac.compare_digest(seal, account.legacy_chain_seal):
                violations.append(Violation("ledger", f"organization {organization_id}: its unkeyed entries up "
                                                      f"to {legacy_end[organization_id]} do not match their seal"))
    return violations


def check_hierarchy() -> list[Violation]:
    violations: list[Violation] = []
    for task in Task.objects.exclude(run_id=F("agent__run_id")).values("id", "run_id", "agent_id"):
        violations.append(Violation("hierarchy", f"task {task['id']} names run {task['run_id']} but its agent "
                                                 f"{task['agent_id']} belongs to another run"))
    for step in Step.objects.exclude(run_id=F("task__run_id")).values("id", "run_id", "task_id"):
        violations.append(Violation("hierarchy", f"step {step['id']} names run {step['run_id']} but its task "
                                                 f"{step['task_id']} belongs to another run"))
    empty_agents = Agent.objects.annotate(n=Count("tasks")).filter(n=0).values_list("id", flat=True)
    for agent_id in empty_agents:
        violations.append(Violation("hierarchy", f"agent {agent_id} has no tasks"))
    empty_tasks = Task.objects.annotate(n=Count("steps")).filter(n=0).values_list("id", flat=True)
    for task_id in empty_tasks:
        violations.append(Violation("hierarchy", f"task {task_id} has no steps"))
    agent_counts = dict(
        Agent.objects.filter(attempt_number=F("run__attempt_number")).values("run_id")
        .annotate(n=Count("id")).values_list("run_id", "n")
    )
    built = Run.objects.exclude(status__in=[*NOT_STARTED_RUN_STATES, Run.Status.CANCELLED, Run.Status.FAILED])
    for run in built.only("id", "plan", "replan_count"):
        expected = len(run.plan.get("agents", [])) if isinstance(run.plan, dict) else 0
        found = agent_counts.get(run.pk, 0)
        if found != expected and not (run.replan_count and found > expected):  # a re-plan adds agents
            violations.append(Violation("hierarchy", f"run {run.pk}: {agent_counts.get(run.pk, 0)} agents in its "
                                                     f"current attempt, the plan has {expected}"))
    return violations


def check_state_consistency() -> list[Violation]:
    violations: list[Violation] = []
    current = Agent.objects.filter(attempt_number=F("run__attempt_number"))
    stats: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in current.values("run_id", "status").annotate(n=Count("id")).order_by():
        stats[row["run_id"]][row["status"]] += row["n"]
    fields = ("id", "status", "last_error_code", "completed_at", "cancelled_at", "duration_ms", "started_at")
    for run in Run.objects.values(*fields).iterator(chunk_size=2000):
        agents = stats.get(run["id"], {})
        live = sum(agents.get(s, 0) for s in LIVE_NODE_STATES)
        status = run["status"]
        where = f"run {run['id']} ({status})"
        if status in NOT_STARTED_RUN_STATES and sum(agents.values()):
            violations.append(Violation("state", f"{where} has agents in its current attempt before running"))
        elif status == Run.Status.RUNNING and not live:
            violations.append(Violation("state", f"{where} has no pending, running or paused agent"))
        elif status == Run.Status.COMPLETED:
            if live or not agents.get(NodeStatus.COMPLETED):
                violations.append(Violation("state", f"{where}: agents still live or none completed {dict(agents)}"))
            if run["completed_at"] is None or run["duration_ms"] is None:
                violations.append(Violation("state", f"{where}: completed_at or duration_ms missing"))
        elif status == Run.Status.FAILED:
            if live:
                violations.append(Violation("state", f"{where} still has live agents {dict(agents)}"))
            if not run["last_error_code"]:
                violations.append(Violation("state", f"{where} has no last_error"))
        elif status == Run.Status.CANCELLED:
            if live:
                violations.append(Violation("state", f"{where} still has live agents {dict(agents)}"))
            if run["cancelled_at"] is None or run["duration_ms"] is None:
                violations.append(Violation("state", f"{where}: cancelled_at or duration_ms missing"))
        elif status == Run.Status.PAUSED and agents.get(NodeStatus.RUNNING):
            violations.append(Violation("state", f"{where} has running agents"))
    for artifact in Artifact.objects.filter(run__status=Run.Status.COMPLETED, expires_at__isnull=True).values("id"):
        violations.append(Violation("state", f"artifact {artifact['id']} of a completed run has no expiry"))
    return violations


CHECKS = {
    "credits": check_credits,
    "ledger": check_ledger_integrity,
    "hierarchy": check_hierarchy,
    "state": check_state_consistency,
}


def invariants_check(*, only: list[str] | None = None) -> list[Violation]:
    violations: list[Violation] = []
    for name, check in CHECKS.items():
        if only and name not in only:
            continue
        violations.extend(check())
    return violations
