"""The escalation runbooks: escalate a run by hand, acknowledge and resolve its ticket (one ticket
per run gathers every trigger). Declared like the run runbooks (``runs.runbooks``), which register
them after their own.
"""

from __future__ import annotations


from django import forms
from django.db import transaction

from core.runbooks import Plan, RunbookForm, Skip, by_id, runbook_register, transition
from runs.models import (
    EscalationTicket,
    Run,
)
from runs.selectors import run_open_escalation
from runs.services import escalations

from runs.runbooks import RunRunbook, TicketRunbook, _held


# --- escalate -----------------------------------------------------------------------------

def _escalate_plan(run: Run, options: dict) -> Plan:
    ticket = run_open_escalation(run=run)
    change = (f"adds a manual trigger to escalation ticket {ticket.pk} ({ticket.status})" if ticket else
              "opens a manual escalation ticket")
    return Plan(current=run.status, change=f"{change} (run stays {run.status})", credits=_held(run),
                skip=_escalated_manually(ticket))


def _escalated_manually(ticket: EscalationTicket | None) -> str:
    """A run's open incident already escalated by an operator: a repeated escalation is a no-op."""
    if ticket is None or not any(entry.get("trigger") == EscalationTicket.Trigger.MANUAL for entry in ticket.triggers):
        return ""
    return f"already escalated (ticket {ticket.pk}, {ticket.status})"


def _escalate(run: Run, *, actor, reason: str, options: dict) -> str:
    skip = _escalated_manually(run_open_escalation(run=run))
    if skip:
        raise Skip(skip)
    with transaction.atomic():
        ticket, created = escalations.escalation_open(run=run, trigger=EscalationTicket.Trigger.MANUAL,
                                                      detail=reason, actor=actor, reason=reason,
                                                      severity=options.get("severity") or "high")
    if not created:
        return f"added a manual trigger to escalation ticket {ticket.pk} ({ticket.status})"
    return f"opened escalation ticket {ticket.pk}"


SEVERITIES = ("critical", "high", "medium", "low")


class EscalateForm(RunbookForm):
    severity = forms.ChoiceField(choices=[(value, value) for value in SEVERITIES], initial="high")


RUN_ESCALATE = RunRunbook(
    name="escalate", title="Escalate", permission="runs.escalate_run", permission_label="Can escalate a run",
    plan=_escalate_plan, perform=_escalate, option_names=("severity",), form=EscalateForm, command="escalate_run",
    arguments=lambda parser: parser.add_argument("--severity", choices=list(SEVERITIES), default="high"),
    command_options=lambda options: {"severity": options["severity"]},
    description="Open a manual escalation ticket for runs (the reason is the ticket's detail); one open ticket per "
                "run: a run already escalated gets the manual trigger added to its open ticket.")


# --- escalation tickets -------------------------------------------------------------------

def _ticket_credits(ticket: EscalationTicket) -> str:
    run = ticket.run
    return f"run {run.pk} ({run.status}): {_held(run)}"


def _acknowledge_plan(ticket: EscalationTicket, options: dict) -> Plan:
    skip = f"already {ticket.status}" if ticket.status != EscalationTicket.Status.OPEN else ""
    return Plan(current=ticket.status, change=f"{ticket.status} → acknowledged", credits=_ticket_credits(ticket),
                skip=skip)


ESCALATION_ACKNOWLEDGE = TicketRunbook(
    name="acknowledge", title="Acknowledge", plan=_acknowledge_plan,
    perform=transition(by_id(escalations.escalation_acknowledge, "ticket_id")),
    action_label="Acknowledge selected escalations…", command="acknowledge_escalation",
    description="Acknowledge open escalation tickets (open → acknowledged): someone is on it.")


def _resolve_plan(ticket: EscalationTicket, options: dict) -> Plan:
    skip = "already resolved" if ticket.status == EscalationTicket.Status.RESOLVED else ""
    return Plan(current=ticket.status, change=f"{ticket.status} → resolved (the reason is the resolution)",
                credits=_ticket_credits(ticket), skip=skip)


class ResolveForm(RunbookForm):
    reason = forms.CharField(widget=forms.Textarea(attrs={"rows": 3, "cols": 80}), max_length=2000,
                             label="Resolution", error_messages={"required": "A resolution is required."},
                             help_text="What was done. Recorded as the ticket's resolution "
                                       "and in the audit trail.")


ESCALATION_RESOLVE = TicketRunbook(
    name="resolve", title="Resolve", plan=_resolve_plan,
    perform=transition(by_id(escalations.escalation_resolve, "ticket_id")), form=ResolveForm,
    action_label="Resolve selected escalations…", command="resolve_escalation",
    description="Resolve escalation tickets (open or acknowledged → resolved); the reason is the resolution.")


RUNBOOKS = (RUN_ESCALATE, ESCALATION_ACKNOWLEDGE, ESCALATION_RESOLVE)


def runbooks_register() -> None:
    """``RunsConfig.ready``: the escalation runbooks join the registry after the run runbooks."""
    for runbook in RUNBOOKS:
        runbook_register(runbook)
