from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = "Credits and ledger"

    def ready(self):
        from billing.metrics import billing_collect, ledger_rollup
        from billing.models import CreditAccount, LedgerEntry
        from core.metrics import COLLECTORS, COMPACTORS
        from core.planner import statistics_tables_register

        statistics_tables_register(CreditAccount, LedgerEntry)  # locked and appended to by every charge

        if billing_collect not in COLLECTORS:
            COLLECTORS.append(billing_collect)
        if ledger_rollup not in COMPACTORS:
            COMPACTORS.append(ledger_rollup)
