"""A Celery app for the CLI tests: loaded by ``celery-pglock --app`` and ``celery -A``."""

from __future__ import annotations

import os

from celery import Celery

from celery_pglock import SingletonTask

app = Celery("cli", broker="memory://", set_as_current=False)
app.conf.pglock_database_url = os.environ.get("CELERY_PGLOCK_TEST_DATABASE_URL")
app.conf.pglock_namespace = os.environ.get("PGLOCK_CLI_NAMESPACE", "cli")


@app.task(base=SingletonTask, lock_args=("tenant_id", "spec"))
def export(tenant_id, spec=None, fmt="csv"):
    return tenant_id


@app.task(base=SingletonTask)
def settle():
    return "settled"


@app.task(base=SingletonTask, lock_id=(42, 1001))
def pinned():
    return "pinned"


# shared=False: an app-wide pglock_fencing in another test must not meet it.
@app.task(base=SingletonTask, shared=False, lock_limit=3)
def batch():
    return "batched"


# The longest lock_period of this app: what `pglock periods prune` may delete past.
@app.task(base=SingletonTask, shared=False, lock_period=3600)
def throttled():
    return "throttled"


@app.task(base=SingletonTask, shared=False, lock_period=60)
def often():
    return "often"


# Three runs per tenant at once: its slots depend on the arguments.
@app.task(base=SingletonTask, shared=False, lock_args=("tenant_id",), lock_limit=3)
def tenant_batch(tenant_id):
    return tenant_id


class _Tiered(SingletonTask):
    abstract = True

    def lock_limit_for(self, tenant_id):
        return 3 if tenant_id == 7 else 1


# Tenant 7 may run three at once, others one (lock_limit_for): `pglock locks` shows "*".
@app.task(base=_Tiered, shared=False, lock_args=("tenant_id",))
def tiered_batch(tenant_id):
    return tenant_id


# Two of the whole group "exports" at once, whatever the tenant: `pglock locks` names
# the group's slots.
@app.task(
    base=SingletonTask,
    shared=False,
    lock_args=("tenant_id",),
    lock_group="exports",
    lock_group_limit=2,
)
def grouped_export(tenant_id):
    return tenant_id
