"""Option validation at registration time, and resolution order. No I/O."""

from __future__ import annotations

import re

import pytest
from celery import Celery

from celery_pglock import (
    ConfigurationError,
    LockScope,
    OnBusy,
    SingletonTask,
    SkipResult,
    make_key,
    metrics,
)
from celery_pglock import config as config_module
from celery_pglock.config import Rate


@pytest.fixture
def app():
    app = Celery("unit", broker="memory://", set_as_current=False)
    app.conf.pglock_database_url = "postgresql+psycopg2://u:secret@engines.invalid/app"
    return app


def register(app, fun=None, **options):
    """Register a SingletonTask and force Celery to bind it (where validation runs)."""

    def export(tenant_id, fmt="csv", *, region="eu"):
        return tenant_id

    fun = fun or export
    task = app.task(
        base=SingletonTask, name=f"unit.{fun.__name__}", shared=False, **options
    )(fun)
    app.finalize(auto=True)
    return app.tasks[task.name]


def test_defaults(app):
    """No options: one lock per task name, skip when busy, session scope."""
    options = register(app).lock_config
    assert OnBusy.SKIP == options.on_busy
    assert LockScope.SESSION == options.scope
    assert options.fixed_key is not None
    assert "unit.export" in options.fixed_key.text


def test_task_option_beats_app_setting_beats_default(app):
    """Resolution order: task attribute > app.conf.pglock_* > default."""
    app.conf.pglock_on_busy = "raise"
    app.conf.pglock_wait_timeout = 3
    options = register(app, lock_on_busy="wait").lock_config
    assert OnBusy.WAIT == options.on_busy
    assert 3.0 == options.wait_timeout
    assert 30.0 == options.retry_delay


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        (
            {"lock_args": ("tenant",)},
            ["lock_args", "'tenant' is not one of them", "tenant_id, fmt, region"],
        ),
        ({"lock_args": 7}, ["lock_args", "parameter name"]),
        ({"lock_args": ("tenant_id", "tenant_id")}, ["at most once"]),
        (
            {"lock_key": lambda *a, **k: 1},
            ["unknown option 'lock_key'", "Known options: lock_args"],
        ),
        ({"lock_id": 2**63}, ["lock_id", "64-bit"]),
        ({"lock_id": (42, 2**31)}, ["lock_id", "32-bit"]),
        ({"lock_id": 5, "lock_args": ("tenant_id",)}, ["only one of"]),
        (
            {"lock_on_busy": "skp"},
            ["lock_on_busy='skp'", "'skip', 'raise', 'retry', 'wait'"],
        ),
        ({"lock_scope": "global"}, ["lock_scope='global'", "'session', 'transaction'"]),
        (
            {"lock_wait_timeout": 0},
            ["lock_wait_timeout=0", "positive number of seconds"],
        ),
        ({"lock_wait_timeout": float("inf")}, ["always bounded"]),
        ({"lock_retry_delay": -1}, ["lock_retry_delay=-1"]),
        ({"lock_namespace": ""}, ["lock_namespace"]),
        (
            {"lock_skip_result": "ignore"},
            ["lock_skip_result='ignore'", "'failure', 'success'"],
        ),
        ({"lock_shadow": "yes"}, ["lock_shadow='yes'", "True or False"]),
        ({"lock_fencing": 1}, ["lock_fencing=1", "True or False"]),
        (
            {"lock_skip_result": "skipped"},
            ["lock_skip_result='skipped'", "'failure', 'success'"],
        ),
        ({"lock_db_timeout": 0}, ["lock_db_timeout=0", "positive number"]),
        ({"lock_period": 0}, ["lock_period=0", "positive number of seconds"]),
        ({"lock_period": -5}, ["lock_period=-5", "positive number of seconds"]),
        ({"lock_period": "5"}, ["lock_period='5'", "positive number of seconds"]),
        ({"lock_period": True}, ["lock_period=True", "positive number of seconds"]),
        ({"lock_period": float("inf")}, ["lock_period=inf", "finite number"]),
        ({"lock_rate": "3"}, ["lock_rate='3'", "'N/unit' (unit s, m, h or d"]),
        ({"lock_rate": "3/w"}, ["lock_rate='3/w'", "'10/m', '3/10s'"]),
        ({"lock_rate": "0/m"}, ["lock_rate='0/m'", "N an int from 1 to 1000"]),
        ({"lock_rate": "1001/h"}, ["lock_rate='1001/h'", "from 1 to 1000"]),
        (
            {"lock_rate": (3, 0)},
            ["lock_rate=(3, 0)", "the window: a positive number of seconds"],
        ),
        ({"lock_rate": "²/m"}, ["lock_rate='²/m'", "'N/unit'"]),
        (
            {"lock_name": "celery_pglock.group:exports"},
            ["lock_name='celery_pglock.group:exports'", "not starting with"],
        ),
        ({"lock_rate": (2.5, 10)}, ["lock_rate=(2.5, 10)", "N an int"]),
        ({"lock_rate": 10}, ["lock_rate=10", "or a pair (N starts, window seconds)"]),
        (
            {"lock_rate": "3/10s", "lock_period": 10},
            [
                "lock_period=10",
                "None with lock_rate (lock_period=P is lock_rate=(1, P))",
            ],
        ),
        (
            {"lock_arg": ("tenant_id",)},
            ["unknown option 'lock_arg'", "did you mean 'lock_args'"],
        ),
    ],
)
def test_bad_options_fail_at_registration(app, options, fragments):
    """Each bad option raises ConfigurationError naming the task, the option, the expectation."""
    with pytest.raises(ConfigurationError) as caught:
        register(app, **options)
    message = str(caught.value)
    assert "unit.export" in message
    for fragment in fragments:
        assert fragment in message


def test_fencing_is_off_by_default_and_set_per_task_or_app_wide(app):
    """lock_fencing: False by default; app.conf.pglock_fencing turns it on; a task
    attribute wins; a non-bool app setting is named as the setting."""
    assert not register(app).lock_config.fencing
    app.conf.pglock_fencing = True

    def other():
        return None

    def off():
        return None

    assert register(app, other).lock_config.fencing
    assert not register(app, off, lock_fencing=False).lock_config.fencing
    app.conf.pglock_fencing = "yes"

    def third():
        return None

    with pytest.raises(ConfigurationError, match=r"app\.conf\.pglock_fencing"):
        register(app, third)


@pytest.mark.parametrize(
    ("option", "hint"),
    [("error_retries", None), ("check_timeout", "lock_db_timeout")],
)
def test_names_of_pre_release_options_are_unknown_options(app, option, hint):
    """Option names dropped before the first release are plain unknown names (the
    package was never released: there is no table of replacements), refused at
    registration as a task option and as an app setting, never silently ignored."""
    with pytest.raises(ConfigurationError) as caught:
        register(app, **{f"lock_{option}": 5})
    message = str(caught.value)
    assert f"unknown option 'lock_{option}'" in message
    assert "Known options: lock_args" in message
    assert hint == caught.value.suggestion
    app.conf[f"pglock_{option}"] = 5

    def other():
        return None

    with pytest.raises(ConfigurationError) as caught:
        register(app, other)
    assert f"Unknown setting 'pglock_{option}'" in str(caught.value)


def test_until_started_implies_wait_only_when_lock_on_busy_is_unset(app):
    """lock_enqueue='until_started' makes an unset lock_on_busy 'wait', and the config
    says it was implied (what `pglock check` shows); a set one, task or app-wide, wins."""
    options = register(app, lock_enqueue="until_started").lock_config
    assert (OnBusy.WAIT, True) == (options.on_busy, options.on_busy_implied)

    def skipping():
        return None

    options = register(
        app, skipping, lock_enqueue="until_started", lock_on_busy="skip"
    ).lock_config
    assert (OnBusy.SKIP, False) == (options.on_busy, options.on_busy_implied)
    app.conf.pglock_on_busy = "retry"

    def retrying():
        return None

    options = register(app, retrying, lock_enqueue="until_started").lock_config
    assert (OnBusy.RETRY, False) == (options.on_busy, options.on_busy_implied)


def test_lock_period_is_lock_rate_of_one_per_task_and_off_by_default(app):
    """lock_rate and lock_period: None by default; "N/unit", "N/<count><unit>" or a pair
    per task; lock_period=P is lock_rate=(1, P). An app-wide pglock_rate or pglock_period
    is refused as a setting that does not exist, saying to set it on the task."""
    assert None is register(app).lock_config.rate

    def ticks():
        return None

    assert Rate(1, 5.0) == register(app, ticks, lock_period=5).lock_config.rate
    for index, (spelled, rate) in enumerate(
        [
            ("10/m", Rate(10, 60.0)),
            ("3/10s", Rate(3, 10.0)),
            ("1/h", Rate(1, 3600.0)),
            ("2/3d", Rate(2, 3 * 86400.0)),
            ((3, 0.5), Rate(3, 0.5)),
        ]
    ):

        def rated():
            return None

        rated.__name__ = f"rated{index}"
        assert rate == register(app, rated, lock_rate=spelled).lock_config.rate
    assert "3/10s" == str(Rate(3, 10.0))
    for setting in ("pglock_period", "pglock_rate"):
        app = Celery("unit", broker="memory://", set_as_current=False)
        app.conf.update({"pglock_database_url": "postgresql://h/db", setting: 60})

        def other():
            return None

        other.__name__ = f"other_{setting}"
        with pytest.raises(ConfigurationError) as caught:
            register(app, other)
        option = setting.replace("pglock_", "lock_")
        assert f"{setting!r} is not a setting: set {option} on the task" in str(
            caught.value
        )


def test_db_timeout_resolves_from_the_task_or_app_wide(app):
    """lock_db_timeout: 5 s by default, app.conf.pglock_db_timeout, the task wins."""
    assert 5.0 == register(app).lock_config.db_timeout
    app.conf.pglock_db_timeout = 2

    def other():
        return None

    def own():
        return None

    assert 2.0 == register(app, other).lock_config.db_timeout
    assert 1.5 == register(app, own, lock_db_timeout=1.5).lock_config.db_timeout


def test_catch_all_parameters_cannot_be_lock_args(app):
    """**kwargs names are not parameters: the error points to lock_key_for."""

    def handler(*args, **kwargs):
        return None

    with pytest.raises(ConfigurationError, match="override lock_key_for"):
        register(app, fun=handler, lock_args=("kwargs",))


def test_unknown_app_setting_is_an_error(app):
    """A typo in app.conf.pglock_* is refused with a hint, never ignored."""
    app.conf.pglock_on_bussy = "raise"
    with pytest.raises(ConfigurationError, match="did you mean 'pglock_on_busy'"):
        register(app)


def test_lock_args_bind_through_the_signature(app):
    """f(7), f(tenant_id=7), f(7, fmt='pdf') contend for one key; defaults apply."""
    task = register(app, lock_args=("tenant_id",))
    key = task.lock_key_for(7)
    assert key == task.lock_key_for(tenant_id=7)
    assert key == task.lock_key_for(7, fmt="pdf")
    assert key == task.lock_key_for(7, "pdf", region="us")
    assert key != task.lock_key_for(8)
    region = register(
        Celery("unit", broker="memory://", set_as_current=False), lock_args=("region",)
    )
    assert region.lock_key_for(1) == region.lock_key_for(2, region="eu")


def test_bound_task_drops_self(app):
    """bind=True tasks: 'self' is not a lockable parameter and positions shift correctly."""

    def export(self, tenant_id):
        return tenant_id

    task = register(app, fun=export, bind=True, lock_args=("tenant_id",))
    assert task.lock_key_for(3) == task.lock_key_for(tenant_id=3)
    with pytest.raises(ConfigurationError):
        register(
            Celery("unit", broker="memory://", set_as_current=False),
            fun=export,
            bind=True,
            lock_args=("self",),
        )


def test_an_overridden_lock_key_for_gets_the_call_arguments(app):
    """A subclass's lock_key_for is called like the task; its key is the task's key."""

    class Custom(SingletonTask):
        abstract = True

        def lock_key_for(self, tenant_id, fmt="csv", **_):
            config = self.lock_config
            return make_key(
                config.namespace, config.name, {"tenant": tenant_id, "fmt": fmt}
            )

    def custom(tenant_id, fmt="csv"):
        return tenant_id

    app.task(base=Custom, name="unit.custom", shared=False)(custom)
    app.finalize(auto=True)
    task = app.tasks["unit.custom"]
    assert '{"fmt":"pdf","tenant":7}' in task.lock_key_for(7, fmt="pdf").text
    assert task._binding().custom_key


def test_lock_name_shares_a_lock_between_tasks(app):
    """Tasks with one lock_name and equal lock_args values get one key."""

    def export(tenant_id):
        return tenant_id

    def purge(tenant_id):
        return tenant_id

    first = register(app, fun=export, lock_name="tenant", lock_args=("tenant_id",))
    second = register(app, fun=purge, lock_name="tenant", lock_args=("tenant_id",))
    assert first.lock_key_for(1) == second.lock_key_for(1)


def test_lock_id_is_used_verbatim(app):
    """An explicit (namespace, resource) pair is the key, as in the article's (42, 1001)."""
    assert (42, 1001) == register(app, lock_id=(42, 1001)).lock_key_for(5).ids


def test_bad_app_setting_is_named_as_the_setting(app):
    """A bad app-wide default names app.conf.pglock_*, not only the task option."""
    app.conf.pglock_retry_delay = -1
    with pytest.raises(ConfigurationError, match=r"app\.conf\.pglock_retry_delay"):
        register(app)


def test_memoised_scalar_keys_keep_types_apart(app):
    """The per-task key cache never merges 1, True, "1" or 1.0, and agrees with make_key."""
    from celery_pglock import keys

    task = register(app, lock_args=("tenant_id",))
    distinct = {
        task.lock_key_for(value).ids for value in (1, True, "1", 1.0, None, 0, False)
    }
    assert 7 == len(distinct)
    for value in (1, True, "1", None):
        expected = keys.make_key("default", "unit.export", {"tenant_id": value})
        assert (
            expected == task.lock_key_for(value) == task.lock_key_for(tenant_id=value)
        )


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        (
            {"unique_on": ["tenant_id"]},
            [
                "'unique_on' is a celery-singleton option",
                "(left in place, its key names would not pick the lock, which follows "
                "lock_args (without them, one lock covers every argument value))",
                "lock_args=('tenant_id',)",
            ],
        ),
        ({"unique_on": "tenant_id"}, ["lock_args=('tenant_id',)"]),
        (
            {"once": {"keys": ["tenant_id"], "graceful": True, "timeout": 60}},
            [
                "'once' is a celery-once option",
                "lock_enqueue='until_finished' with lock_args=('tenant_id',)",
                "lock_enqueue_on_duplicate",
                "no expiry to choose",
            ],
        ),
        ({"once": {"keys": []}}, ["no lock_args (one lock per task)"]),
        ({"once": {"graceful": True}}, ["lock_args naming every parameter"]),
        (
            {"raise_on_duplicate": True},
            [
                "celery-singleton",
                "(left in place, a duplicate would not raise)",
                "lock_enqueue_on_duplicate='raise'",
            ],
        ),
        (
            {"lock_expiry": 3600},
            [
                "'lock_expiry' is a celery-singleton option",
                "(left in place, it would set no expiry, and none is needed)",
                "remove it",
            ],
        ),
        (
            {"heimdall": {"unique": True}},
            ["celery-heimdall", "lock_args (or override lock_key_for)"],
        ),
    ],
)
def test_peer_options_are_refused_naming_our_equivalent(app, options, fragments):
    """celery-once/-singleton/-heimdall option names fail at registration with our equivalent.

    Accepted silently, they would do nothing: a task keyed per tenant through them would
    get one lock for every tenant, a raise_on_duplicate would not raise.
    """
    with pytest.raises(ConfigurationError) as caught:
        register(app, **options)
    message = str(caught.value)
    assert "unit.export" in message
    assert "docs/migration.md" in message
    for fragment in fragments:
        assert fragment in message


def test_peer_option_on_a_subclass_is_refused(app):
    """A shared base class carrying a peer option (a half-migrated QueueOnce) is refused too."""

    class Migrated(SingletonTask):
        abstract = True
        unique_on = ("tenant_id",)

    def export(tenant_id):
        return tenant_id

    app.task(base=Migrated, name="unit.export", shared=False)(export)
    with pytest.raises(ConfigurationError, match="with lock_args=\\('tenant_id',\\)"):
        app.finalize(auto=True)


def test_namespaced_settings_are_read_and_typos_refused():
    """Django-style CELERY_PGLOCK_* settings are used, and a typo among them is an error."""
    import sys
    import types

    settings = types.ModuleType("unit_django_settings")
    settings.CELERY_BROKER_URL = "memory://"  # type: ignore[attr-defined]
    settings.CELERY_PGLOCK_DATABASE_URL = "postgresql+psycopg2://u@h/db"  # type: ignore[attr-defined]
    settings.CELERY_PGLOCK_ON_BUSY = "raise"  # type: ignore[attr-defined]
    sys.modules[settings.__name__] = settings
    try:
        app = Celery("unit", set_as_current=False)
        app.config_from_object(settings.__name__, namespace="CELERY")
        assert OnBusy.RAISE == register(app).lock_config.on_busy

        settings.CELERY_PGLOCK_ON_BUSSY = "skip"  # type: ignore[attr-defined]
        typo = Celery("unit", set_as_current=False)
        typo.config_from_object(settings.__name__, namespace="CELERY")
        with pytest.raises(
            ConfigurationError,
            match="'CELERY_PGLOCK_ON_BUSSY'; did you mean 'CELERY_PGLOCK_ON_BUSY'",
        ):
            register(typo)
    finally:
        del sys.modules[settings.__name__]


def test_skip_result_and_shadow_resolve_from_app_settings(app):
    """pglock_skip_result / pglock_shadow are app-wide defaults; failure/off by default."""
    defaults = register(app).lock_config
    assert (SkipResult.FAILURE, False) == (defaults.skip_result, defaults.shadow)
    app.conf.pglock_skip_result = "success"
    app.conf.pglock_shadow = True

    def other(tenant_id):
        return tenant_id

    options = register(app, other).lock_config
    assert (SkipResult.SUCCESS, True) == (options.skip_result, options.shadow)


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"pglock_metrics_port": "9808"}, "pglock_metrics_port='9808'"),
        ({"pglock_metrics_port": 70000}, "(1-65535)"),
        ({"pglock_metrics_address": ""}, "pglock_metrics_address=''"),
        ({"pglock_metrics": "statsd"}, "pglock_metrics='statsd'"),
        (
            {"pglock_metrics": metrics.NullMetrics(), "pglock_metrics_port": 9808},
            "cannot be combined",
        ),
    ],
)
def test_bad_metrics_settings_fail_at_registration(app, settings, fragment):
    """Metrics settings are validated when a SingletonTask is bound."""
    app.conf.update(settings)
    with pytest.raises(ConfigurationError, match=re.escape(fragment)):
        register(app)


def test_a_custom_metrics_sink_is_installed(app):
    """pglock_metrics may be any object implementing the Metrics protocol."""
    sink = metrics.NullMetrics()
    app.conf.pglock_metrics = sink
    try:
        register(app)
        assert sink is metrics.current()
    finally:
        metrics.install(metrics.NullMetrics())


def test_an_unknown_setting_is_refused_naming_the_known_ones():
    """pglock_session_mode (dropped before the first release) is an unknown setting."""
    with pytest.raises(ConfigurationError) as caught:
        config_module.check_unknown_settings({"pglock_session_mode": "per_lock"})
    assert "Unknown setting 'pglock_session_mode'" in str(caught.value)
    assert "Known settings: pglock_namespace" in str(caught.value)


def test_on_misconfigured_database_is_checked_at_worker_start(app):
    """pglock_on_misconfigured_database is 'stop' unless set; a bad value stops the
    worker's start-up check, naming the setting and the values it takes."""
    from celery_pglock.task import worker_hooks

    register(app)
    assert config_module.OnMisconfiguredDatabase.STOP is (
        config_module.on_misconfigured_database(app.conf)
    )
    app.conf.pglock_on_misconfigured_database = "run"
    worker_hooks.check_app(app)
    assert config_module.OnMisconfiguredDatabase.RUN is (
        config_module.on_misconfigured_database(app.conf)
    )
    app.conf.pglock_on_misconfigured_database = "ignore"
    with pytest.raises(ConfigurationError) as caught:
        worker_hooks.check_app(app)
    assert "pglock_on_misconfigured_database='ignore' is invalid" in str(caught.value)
    assert "one of 'stop', 'run'" in str(caught.value)


def test_producer_metrics_refuse_a_custom_sink_and_a_bad_port(app):
    """producer_registry() has nothing to serve when pglock_metrics is a custom sink, and
    serve_producer() names its bad port argument; both say what they expected."""
    with pytest.raises(ConfigurationError, match=r"serve_producer\(port='9809'\)"):
        metrics.serve_producer(app, port="9809")

    class Counting(metrics.NullMetrics):
        pass

    app.conf.pglock_metrics = Counting()
    register(app)
    try:
        with pytest.raises(ConfigurationError, match="expected pglock_metrics unset"):
            metrics.producer_registry(app)
    finally:
        metrics.install(metrics.NullMetrics())
