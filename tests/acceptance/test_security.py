"""Secrets and argument values stay out of logs and the result backend; big arguments are
not pinned in memory. Real ``celery worker`` processes (tests/acceptance/security_app.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from celery_pglock.testing import WorkerProcess

MIB = 1024 * 1024
#: Worker environments for the memory test. With glibc's defaults, RSS also counts big
#: blocks that were freed late (the allocator keeps them in its heap); with a fixed mmap
#: threshold every freed big block goes back to the OS, so RSS growth is exactly what is
#: still referenced. Both must match a plain task's.
ALLOCATORS = {
    "glibc-defaults": {},
    "fixed-mmap-threshold": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}
#: An e-mail address as a dict key and a value next to it: personal data in arguments.
SECRET_KEY = "alice.leakme@example.com"
SECRET_VALUE = "s3cret-LEAKME-value"


@pytest.fixture(scope="module")
def security_env(services) -> dict[str, str]:
    from tests.conftest import REPO_ROOT

    return {
        **services.env(),
        "PGLOCK_SECURITY_QUEUE": f"pglock-security-{uuid.uuid4().hex[:8]}",
        "PGLOCK_TEST_NAMESPACE": f"security-{uuid.uuid4().hex[:8]}",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
        ),
    }


@pytest.fixture(scope="module")
def security(security_env):
    """The security app, configured like its workers."""
    previous = {name: os.environ.get(name) for name in security_env}
    os.environ.update(security_env)
    import tests.acceptance.security_app as module

    module.app.conf.task_default_queue = security_env["PGLOCK_SECURITY_QUEUE"]
    yield module
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def one_child_worker(security, security_env, tmp_path_factory):
    """A prefork worker with ONE pool child, so every task runs in the same process."""
    worker = WorkerProcess(
        "tests.acceptance.security_app",
        env=security_env,
        concurrency=1,
        queues=[security_env["PGLOCK_SECURITY_QUEUE"]],
        log_path=tmp_path_factory.mktemp("security") / "worker.log",
    )
    worker.start(timeout=90)
    yield worker
    worker.stop(timeout=20)


def test_refused_key_stores_no_argument_value(security, one_child_worker):
    """A LockKeyError names the argument path and type: the result backend (message and
    traceback) and the worker log hold neither the dict key text nor the values."""
    payload = {"tenant": 7, SECRET_KEY: [SECRET_VALUE, float("nan")]}
    result = security.keyed.delay(payload)
    with pytest.raises(Exception, match=r"lock key") as caught:
        result.get(timeout=60)
    message = str(caught.value)
    assert "argument 'payload'[key #1][1]" in message
    assert "float that is not finite" in message
    meta = security.app.backend.get_task_meta(result.id)
    stored = json.dumps(meta, default=repr) + (result.traceback or "")
    one_child_worker.wait_for_log("LockKeyError", timeout=30)  # logged...
    log = one_child_worker.log_text()
    for text in (stored, log):  # ...without the personal data
        assert "leakme" not in text.lower()


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_big_arguments_are_not_kept_in_a_pool_child(
    security, security_env, tmp_path, allocator
):
    """20 distinct 5 MB lock arguments grow a pool child no more than a plain task.

    Before: 219 MiB more with glibc's defaults, 191 MiB with a fixed mmap threshold (the
    key caches kept two copies of each argument, and a request <-> execution cycle kept
    each call's arguments until a garbage collection). The figures are printed (-s);
    benchmarks/key_memory.py prints them too, see docs/operations/security.md.
    """
    growth = {}
    for label, task in (
        ("SingletonTask", security.locked_blob),
        ("plain task", security.plain_blob),
    ):
        queue = f"{security_env['PGLOCK_SECURITY_QUEUE']}-{allocator}-{len(growth)}"
        worker = WorkerProcess(
            "tests.acceptance.security_app",
            env={**security_env, **ALLOCATORS[allocator]},
            concurrency=1,
            queues=[queue],
            log_path=tmp_path / f"{len(growth)}.log",
        ).start(timeout=90)
        try:
            growth[label] = _growth(security, task, queue)
        finally:
            worker.stop(timeout=20)
    print(
        f"{allocator}: pool child RSS growth after 20 distinct 5 MB arguments: "
        + ", ".join(f"{name} {value / MIB:.1f} MiB" for name, value in growth.items())
    )
    assert growth["SingletonTask"] < growth["plain task"] + 10 * MIB


def _growth(security, task, queue):
    options = {"queue": queue}
    task.apply_async(("warm-up",), **options).get(timeout=60)
    before = security.rss.apply_async(**options).get(timeout=60)
    for index in range(20):
        blob = f"{index:04d}" + "x" * (5 * 1000 * 1000 - 4)
        assert len(blob) == task.apply_async((blob,), **options).get(timeout=120)
    after = security.rss.apply_async(**options).get(timeout=60)
    return after - before


def test_worker_refuses_an_ambiguous_url_without_showing_it(security_env):
    """An unescaped '@' in the password stops the worker at start; the message names
    the fix and shows no part of the password."""
    env = {
        **os.environ,
        **security_env,
        "SECURITY_DB_URL": "postgresql+psycopg2://app:p@ssLEAKME@127.0.0.1:5432/test",
    }
    completed = subprocess.run(
        [
            *(sys.executable, "-m", "celery", "-A", "tests.acceptance.security_app"),
            *("worker", "--pool", "solo", "--loglevel", "INFO"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert 0 != completed.returncode
    assert "%40" in output
    assert "LEAKME" not in output
