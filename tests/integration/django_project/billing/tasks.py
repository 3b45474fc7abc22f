"""``@shared_task(base=SingletonTask)``, as docs/guide/django.md writes it."""

from __future__ import annotations

from celery import shared_task

from celery_pglock import SingletonTask


@shared_task(base=SingletonTask, lock_args=("account_id",))
def recompute_balance(account_id, full=False):
    return account_id
