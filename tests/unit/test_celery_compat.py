"""Each Celery behaviour ``celery_pglock.celery_compat`` names, against the installed
Celery: a release that breaks one fails here, under its name. scripts/matrix.sh runs this
file on the oldest Celery claimed, scripts/test.sh on the newest. No broker: sends are
recorded, runs go through Celery's own tracer (``build_tracer``) or eagerly."""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any

import celery
import click
import pytest
from celery import signals as celery_signals
from celery.app.trace import build_tracer
from celery.bin.celery import celery as celery_main
from celery.contrib.testing.mocks import TaskMessage
from celery.exceptions import MaxRetriesExceededError, Retry
from celery.worker.request import Request
from click.testing import CliRunner

from celery_pglock import celery_compat

if TYPE_CHECKING:
    from collections.abc import Iterator

#: The one Celery app of this module: what ``celery -A`` of the module finds.
cli_app = celery.Celery("compat_cli", set_as_current=False)


@pytest.fixture(name="app")
def fresh_app() -> celery.Celery:
    return celery.Celery("compat", set_as_current=False)


@contextlib.contextmanager
def running(task: Any, **request: Any) -> Iterator[Any]:
    """A worker's request on the task's stack (not eager, not a direct call)."""
    task.push_request(called_directly=False, is_eager=False, **request)
    try:
        yield task.request
    finally:
        task.pop_request()


def recording_sends(task: Any) -> list[dict[str, Any]]:
    """Record the options of the task's ``apply_async`` instead of publishing."""
    sent: list[dict[str, Any]] = []

    def apply_async(args: Any = None, kwargs: Any = None, **options: Any) -> None:
        sent.append(options)

    task.apply_async = apply_async
    return sent


def trace(
    app: celery.Celery, task: Any, task_id: str, *args: Any, **request: Any
) -> Any:
    """Run the task as a worker's pool does, through Celery's tracer: its return value."""
    tracer = build_tracer(task.name, task, app=app, eager=False)
    request = {"id": task_id, "delivery_info": {}, **request}
    return tracer(task_id, list(args), {}, request)[0]


# conf_prefix


def test_conf_prefix_is_the_namespace_of_the_settings(app):
    """config_from_object(namespace='CELERY') names settings CELERY_*: conf.prefix says so
    once the settings are read (listed, as config.check_unknown_settings does first)."""

    class Settings:
        CELERY_PGLOCK_NAMESPACE = "compat"

    app.config_from_object(Settings, namespace="CELERY")
    conf = app.conf
    list(conf)
    assert "CELERY_" == celery_compat.conf_prefix(conf)
    assert "CELERY_" == celery_compat.conf_prefix(app.conf)
    assert "compat" == app.conf.get("CELERY_PGLOCK_NAMESPACE")


def test_conf_prefix_of_plain_settings_is_empty(app):
    """Without a namespace, settings are named as written: no prefix."""
    app.conf.update(pglock_namespace="compat")
    list(app.conf)
    assert "" == celery_compat.conf_prefix(app.conf)


# load_app, command_app


def test_load_app_finds_an_app_as_celery_a_does():
    """find_app resolves ``module:attribute`` and a module holding one app."""
    assert cli_app is celery_compat.load_app(f"{__name__}:cli_app")
    assert cli_app is celery_compat.load_app(__name__)


def test_command_app_is_the_app_of_celery_a():
    """`celery -A module:app <plugin command>` gives the command a context holding the app."""
    found: list[Any] = []

    @click.command("compat-probe")
    @click.pass_context
    def probe(ctx: click.Context) -> None:
        found.append(celery_compat.command_app(ctx))

    celery_main.add_command(probe)
    try:
        result = CliRunner().invoke(
            celery_main, ["-A", f"{__name__}:cli_app", "compat-probe"]
        )
    finally:
        celery_main.commands.pop("compat-probe")
    assert 0 == result.exit_code, (result.output, result.exception)
    assert [cli_app] == found


def test_command_app_outside_celery_is_none():
    """A command run on its own (the celery-pglock script) finds no app."""
    found: list[Any] = []

    @click.command()
    @click.pass_context
    def probe(ctx: click.Context) -> None:
        found.append(celery_compat.command_app(ctx))

    assert 0 == CliRunner().invoke(probe, []).exit_code
    assert [None] == found


# task_registry


def test_task_registry_holds_the_bound_tasks_without_finalizing_the_app():
    """Under autofinalize=False, app.tasks refuses while tasks bind; the registry answers,
    and at a task's on_bound holds the tasks bound before it."""
    app = celery.Celery("compat", set_as_current=False, autofinalize=False)
    seen: dict[str, list[str]] = {}

    class Base(celery.Task):  # type: ignore[type-arg]
        @classmethod
        def on_bound(cls, app: celery.Celery) -> None:
            seen[cls.name] = sorted(celery_compat.task_registry(app))

    def first() -> None: ...

    def second() -> None: ...

    app.task(base=Base, name="compat.first", shared=False)(first)
    app.task(base=Base, name="compat.second", shared=False)(second)
    with pytest.raises(RuntimeError):
        _ = app.tasks
    app.finalize()
    assert "compat.first" in seen["compat.second"]
    assert celery_compat.task_registry(app) is app.tasks


# run_parameters


def test_run_parameters_of_each_kind_of_task(app):
    """@app.task stores a plain function as a staticmethod run, a bound one as a plain
    function taking the task first; a Task subclass's run is a method."""

    def plain(a: int, b: int = 1) -> None: ...

    def bound(self: Any, c: int) -> None: ...

    class Explicit(celery.Task):  # type: ignore[type-arg]
        name = "compat.explicit"

        def run(self, d: int) -> None: ...

    app.task(name="compat.plain", shared=False)(plain)
    app.task(name="compat.bound", bind=True, shared=False)(bound)
    plain_task, bound_task = app.tasks["compat.plain"], app.tasks["compat.bound"]
    assert isinstance(inspect.getattr_static(type(plain_task), "run"), staticmethod)
    assert ["a", "b"] == [
        p.name for p in celery_compat.run_parameters(type(plain_task))
    ]
    assert ["c"] == [p.name for p in celery_compat.run_parameters(type(bound_task))]
    assert ["d"] == [p.name for p in celery_compat.run_parameters(Explicit)]


# TRACER_KEEPS_REQUEST: the request the tracer pushes when __call__ is custom


class CustomCall(celery.Task):  # type: ignore[type-arg]
    """A task overriding __call__, as SingletonTask does; records what its run sees."""

    name = "compat.custom_call"
    ignore_result = True
    through_task_call = False  #: Call Task.__call__ even under the tracer.
    seen: list[tuple[Any, ...]]  #: (id, called_directly, is_eager) of each run
    requests: list[tuple[Any, Any]]  #: the request __call__ saw, the one run saw

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.request.compat_marker = "set in __call__"  # type: ignore[attr-defined]
        self.requests.append((self.request, None))
        direct = self.request.called_directly or self.through_task_call
        if direct or not celery_compat.TRACER_KEEPS_REQUEST:
            return super().__call__(*args, **kwargs)
        return self.run(*args, **kwargs)

    def run(self, value: int) -> int:
        request = self.request
        self.seen.append((request.id, request.called_directly, request.is_eager))
        self.requests[-1] = (self.requests[-1][0], request)
        return value * 2


@pytest.fixture
def custom(app):
    CustomCall.seen = []
    CustomCall.requests = []
    CustomCall.through_task_call = False
    task = app.register_task(CustomCall())
    yield task
    CustomCall.through_task_call = False


def test_the_tracer_calls_a_custom_call_with_the_message_request_pushed(app, custom):
    """A worker's tracer and apply() call __call__ with the run's request pushed, so run()
    sees it; task_postrun still sees that request, with what __call__ set on it."""
    at_postrun: list[tuple[Any, ...]] = []

    def postrun(task: Any = None, **_: Any) -> None:
        at_postrun.append(
            (task.request.id, getattr(task.request, "compat_marker", None))
        )

    celery_signals.task_postrun.connect(postrun, weak=False)
    try:
        assert 4 == trace(app, custom, "traced-id", 2)
        assert 6 == custom.apply((3,), task_id="eager-id").get()
    finally:
        celery_signals.task_postrun.disconnect(postrun)
    assert [("traced-id", False, False), ("eager-id", False, True)] == custom.seen
    assert all(at_call is at_run for at_call, at_run in custom.requests)
    assert [
        ("traced-id", "set in __call__"),
        ("eager-id", "set in __call__"),
    ] == at_postrun


def test_task_call_pushes_a_request_of_its_own(app, custom):
    """Task.__call__ pushes a request of its own: under the tracer, run() would see
    another request than the run's (empty on Celery 5.3, a copy on 5.7); a direct call
    gets one, and needs it."""
    custom.through_task_call = True
    assert 4 == trace(app, custom, "traced-id", 2)
    assert 10 == custom(5)
    assert [(None, True, False)] == custom.seen[1:]
    assert [False, False] == [at_call is at_run for at_call, at_run in custom.requests]


# drop_continuations


def test_dropped_continuations_are_not_sent(app):
    """The tracer sends the link callbacks and the chain's next task from the request after
    the body returns: cleared there by the body, neither is sent."""
    app.conf.task_always_eager = True  # a sent callback runs here, and is recorded
    received: list[tuple[str, Any]] = []

    @app.task(name="compat.follower", shared=False)
    def follower(value: Any, how: str) -> None:
        received.append((how, value))

    @app.task(name="compat.skipper", bind=True, shared=False, ignore_result=True)
    def skipper(self: Any, drop: bool) -> str:
        if drop:
            celery_compat.drop_continuations(self.request)
        return "result"

    def continuations() -> dict[str, Any]:
        # Fresh lists each run: Celery 5.3 pops the chain's next task off its list.
        return {
            "callbacks": [follower.s(how="link")],
            "chain": [follower.s(how="chain")],
        }

    trace(app, skipper, "kept-id", False, **continuations())
    assert [("link", "result"), ("chain", "result")] == received  # the control
    received.clear()
    trace(app, skipper, "dropped-id", True, **continuations())
    assert [] == received


# redelivered


@pytest.mark.parametrize("flag", [True, False])
def test_redelivered_is_the_transport_flag_of_the_message(app, flag):
    """The worker's request copies the message's delivery_info['redelivered'] into the
    request a run sees."""
    seen: list[bool] = []

    @app.task(name="compat.redelivery", bind=True, shared=False, ignore_result=True)
    def redelivery(self: Any) -> None:
        seen.append(celery_compat.redelivered(self.request))

    message = TaskMessage(redelivery.name, id="redelivered-id")
    message.delivery_info = {
        "exchange": "",
        "routing_key": "celery",
        "redelivered": flag,
    }
    message.properties = {}
    request = Request(message, app=app, task=redelivery)
    tracer = build_tracer(redelivery.name, redelivery, app=app, eager=False)
    tracer(request.id, [], {}, request.request_dict)
    assert [flag] == seen


# is_retry_send, retry_publishes, forget_max_retries_override


def test_a_retry_sends_retries_a_first_send_does_not(app):
    """retry() re-sends with retries=n+1 among apply_async's options; delay() and a
    signature's first send carry none."""

    @app.task(name="compat.retried", bind=True, shared=False, max_retries=None)
    def retried(self: Any) -> None: ...

    sent = recording_sends(retried)
    retried.delay()
    retried.s().apply_async()
    for retries in (0, 3):
        with running(retried, id="retried-id", retries=retries), pytest.raises(Retry):
            retried.retry(countdown=0)
    assert [None, None, 1, 4] == [options.get("retries") for options in sent]
    assert [False, False, True, True] == [
        celery_compat.is_retry_send(options) for options in sent
    ]


@pytest.mark.parametrize(
    ("retries", "task_limit", "call_limit"),
    [(0, 3, None), (2, 3, None), (3, 3, None), (9, None, None), (1, 3, 1), (0, 0, 5)],
)
def test_retry_publishes_as_retry_decides(app, retries, task_limit, call_limit):
    """retry() publishes while retries + 1 is within the call's limit, else the task's;
    None is unlimited. retry_publishes() predicts it."""

    @app.task(name="compat.limited", bind=True, shared=False, max_retries=task_limit)
    def limited(self: Any) -> None: ...

    sent = recording_sends(limited)
    with running(limited, id="limited-id", retries=retries):
        expected = celery_compat.retry_publishes(limited, call_limit)
        with pytest.raises((Retry, MaxRetriesExceededError)):
            limited.retry(countdown=0, max_retries=call_limit)
    assert expected == bool(sent)


def test_retry_leaves_its_max_retries_on_the_task(app):
    """retry(max_retries=n) stores n on the task object, for later runs too, until
    forget_max_retries_override() drops it."""

    @app.task(name="compat.overridden", bind=True, shared=False)
    def overridden(self: Any) -> None: ...

    recording_sends(overridden)
    with running(overridden, id="overridden-id", retries=0), pytest.raises(Retry):
        overridden.retry(countdown=0, max_retries=7)
    assert 7 == vars(overridden)[celery_compat.MAX_RETRIES_OVERRIDE]
    assert 7 == overridden.override_max_retries  # the attribute autoretry reads
    celery_compat.forget_max_retries_override(overridden)
    assert celery_compat.MAX_RETRIES_OVERRIDE not in vars(overridden)
    celery_compat.forget_max_retries_override(overridden)  # and again: no error


# autoretries, autoretry_options: the copy of Celery's autoretry


class ExcludedError(ValueError):
    """In autoretry_for (a ValueError) and in dont_autoretry_for."""


@pytest.mark.parametrize(
    "error",
    [ValueError("covered"), ExcludedError("excluded"), TypeError("not covered")],
)
@pytest.mark.parametrize("backoff", [False, 2, True])
def test_autoretry_copy_retries_as_celery_autoretry(app, error, backoff):
    """Celery's autoretry wrapper of run() and the copy decide alike whether an error is
    retried, and pass retry() the same arguments (retry_kwargs, the backoff countdown)."""

    def flaky(self: Any, error: BaseException) -> None:
        raise error

    task = app.task(
        name="compat.flaky",
        bind=True,
        shared=False,
        autoretry_for=(ValueError,),
        dont_autoretry_for=(ExcludedError,),
        retry_kwargs={"max_retries": 4},
        retry_backoff=backoff,
        retry_backoff_max=100,
        retry_jitter=False,
    )(flaky)
    calls: list[dict[str, Any]] = []

    def retry(**kwargs: Any) -> Retry:
        calls.append(kwargs)
        return Retry()

    task.retry = retry
    with running(task, id="flaky-id", retries=2):
        copy = (
            celery_compat.autoretry_options(task)
            if celery_compat.autoretries(task, error)
            else None
        )
        with pytest.raises((type(error), Retry)) as raised:
            task.run(error)
    if copy is None:
        assert [] == calls
        assert raised.value is error
    else:
        assert [{"exc": error, **copy}] == calls
    if backoff and copy is not None:
        assert {"max_retries": 4, "countdown": min(100, int(backoff) * 2**2)} == copy
