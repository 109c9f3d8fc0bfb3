"""Reindex migrations: plan, run, checkpoint, verify, swap, rollback, ledger."""
