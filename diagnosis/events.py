"""Event names the diagnosis app writes (the run panel listens for them)."""

from __future__ import annotations

EXPLANATION_EVENT = "diagnosis_explanation"
SUGGESTION_EVENT = "diagnosis_suggestion"
