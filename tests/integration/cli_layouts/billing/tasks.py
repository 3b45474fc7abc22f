"""``@shared_task``, as in a Django app: bound to whichever app is current."""

from __future__ import annotations

from celery import shared_task

from celery_pglock import SingletonTask


@shared_task(base=SingletonTask, name="billing.settle_invoices")
def settle_invoices():
    return "settled"
