"""A task's options resolved once, at bind: each value checked (options.py), then the
rules between options. Each option: docs/reference/options.md."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions, keys
from celery_pglock.config import options, peers, settings

if TYPE_CHECKING:
    import inspect
    from collections.abc import Mapping, Sequence

#: Soonest the server's keepalives free a cut-off client's lock; the margin kept under it.
SERVER_KEEPALIVE_DEADLINE = 10.0 * 3
#: Lock names the library's own keys use (lock_group's: "celery_pglock.group:<name>").
RESERVED_NAMES = "celery_pglock."
LOSS_MARGIN = 5.0


def resolve(
    *,
    task_name: str,
    attributes: Mapping[str, Any],
    conf: Mapping[str, Any],
    parameters: Sequence[inspect.Parameter],
) -> options.LockConfig:
    """One task's options: attribute, else app setting, else default (or ConfigurationError)."""
    for attribute in attributes:
        if attribute in peers.PEER_OPTIONS:
            raise peers.peer_refusal(task_name, attribute, attributes[attribute])
        if attribute not in options.TASK_OPTIONS:
            raise settings.unknown_name(
                f"Task {task_name!r}: ", "option", attribute, options.TASK_OPTIONS
            )
    settings.check_unknown_settings(conf)

    fail = functools.partial(_fail, task_name)
    values: dict[str, Any] = {}
    source: dict[str, str] = {}  # how to name each option in an error
    for field, check in options.CHECKS.items():
        name, setting = f"lock_{field}", f"pglock_{field}"
        where, value = name, getattr(options.DEFAULTS, field)
        if name in attributes:
            value = attributes[name]
        elif field not in options.PER_TASK and conf.get(setting) is not None:
            where, value = f"{name} (from app.conf.{setting})", conf[setting]
        source[field] = where
        try:
            values[field] = check(value)
        except ValueError as exc:
            raise fail(where, value, str(exc)) from None
    lock_name = attributes.get("lock_name", task_name)
    if not isinstance(lock_name, str) or not lock_name:
        raise fail("lock_name", lock_name, "a non-empty string")
    if lock_name.startswith(RESERVED_NAMES):
        expected = (
            f"a name not starting with {RESERVED_NAMES!r} (the library's own keys)"
        )
        raise fail("lock_name", lock_name, expected)
    if values["shadow"] and values["scope"] is options.LockScope.TRANSACTION:
        raise fail(
            source["shadow"],
            True,
            "False with lock_scope='transaction' (a shadowed busy run has no lock "
            "transaction to lend its body): set lock_shadow=False on this task, or "
            "shadow it with lock_scope='session' first",
        )
    if "lock_period" in attributes:  # lock_rate's one-start case
        period = attributes["lock_period"]
        if "lock_rate" in attributes:
            raise fail(
                "lock_period",
                period,
                "None with lock_rate (lock_period=P is lock_rate=(1, P)): set one",
            )
        try:
            values["rate"] = options.Rate(1, options.seconds(period), period=True)
        except ValueError as exc:
            raise fail("lock_period", period, str(exc)) from None
    limit = attributes.get("lock_limit", 1)
    if type(limit) is not int or not 1 <= limit <= keys.SLOT_MAX:
        expected = f"an int from 1 to {keys.SLOT_MAX} (runs of one key at once)"
        raise fail("lock_limit", limit, expected)
    if limit > 1 and values["fencing"]:
        raise fail(
            source["fencing"],
            True,
            f"False with lock_limit={limit} (a fencing token orders the holders of one "
            "key, and lock_limit lets several hold it at once): set lock_fencing=False on "
            "this task, or lock_limit=1",
        )
    group_limit = attributes.get("lock_group_limit")
    if (group_limit is None) is not (values["group"] is None):
        raise fail(
            "lock_group_limit" if values["group"] is None else "lock_group",
            group_limit if values["group"] is None else values["group"],
            "lock_group and lock_group_limit set together (a group and its limit)",
        )
    if group_limit is not None and (
        type(group_limit) is not int or not 1 <= group_limit <= keys.SLOT_MAX
    ):
        expected = f"an int from 1 to {keys.SLOT_MAX} (runs of the whole group at once)"
        raise fail("lock_group_limit", group_limit, expected)
    values["group_limit"] = group_limit or 1
    enqueue = values["enqueue"]
    if enqueue is not None and limit > 1:
        raise fail(
            "lock_limit",
            limit,
            "1 with lock_enqueue (a queued row belongs to one running message; "
            "several slots of one key would share it)",
        )
    if enqueue is not None and values["scope"] is options.LockScope.TRANSACTION:
        raise fail(
            source["enqueue"],
            enqueue.value,
            "None with lock_scope='transaction' (the queued row would change with the "
            "body's transaction, and every send of the key would wait for it): use "
            "lock_scope='session' for a task with lock_enqueue",
        )
    if enqueue is not None and values["shadow"]:
        raise fail(
            source["shadow"],
            True,
            "False with lock_enqueue (a shadowed task must publish every send to "
            "report what the lock would do): set lock_shadow=False on this task, or "
            "shadow the run lock first and add lock_enqueue after",
        )
    user_set = "lock_on_busy" in attributes or conf.get("pglock_on_busy") is not None
    implied = options.implied_on_busy(enqueue)
    if implied is not None and not user_set:
        values["on_busy"], values["on_busy_implied"] = implied, True
    debounce, longest = values["debounce"], values["debounce_max"]
    if longest is not None and (debounce is None or longest < debounce):
        raise fail(
            "lock_debounce_max",
            longest,
            "None without lock_debounce, and at least lock_debounce with it (the "
            "longest a run waits after the first send of its batch)",
        )
    if debounce is not None and enqueue is not options.Enqueue.UNTIL_STARTED:
        raise fail(
            "lock_debounce",
            debounce,
            "None unless lock_enqueue='until_started' (a debounced key holds one "
            "message, and a follow-up of a running one)",
        )
    if debounce is not None:
        if values["enqueue_on_duplicate"] is options.OnDuplicate.RAISE:
            raise fail(
                source["enqueue_on_duplicate"],
                "raise",
                "'replace' (or unset) with lock_debounce: a send during the quiet time "
                "replaces the waiting one",
            )
        values["enqueue_on_duplicate"] = options.OnDuplicate.REPLACE
    replace = values["enqueue_on_duplicate"] is options.OnDuplicate.REPLACE
    if replace and enqueue is not options.Enqueue.UNTIL_STARTED:
        raise fail(
            source["enqueue_on_duplicate"],
            "replace",
            "'return' or 'raise' unless lock_enqueue='until_started' (latest wins "
            "replaces a queued message and keeps one follow-up of a running one; "
            "until_finished would return the running one instead)",
        )
    waits = values["on_busy"] in (options.OnBusy.WAIT, options.OnBusy.RETRY)
    if replace and not waits:
        raise fail(
            source["on_busy"],
            values["on_busy"].value,
            "'wait' (the default) or 'retry' with lock_enqueue_on_duplicate='replace' "
            "and lock_enqueue='until_started' (a follow-up skipped while its key runs "
            "would lose the latest arguments)",
        )
    interval, timeout = values["watch_interval"], values["db_timeout"]
    if (
        interval
        and conf.get("pglock_server_keepalives", True)
        and interval + timeout + LOSS_MARGIN > SERVER_KEEPALIVE_DEADLINE
    ):
        raise exceptions.ConfigurationError(  # docs/operations/lock-loss.md
            f"Task {task_name!r}: {source['watch_interval']}={interval!r} plus "
            f"{source['db_timeout']}={timeout!r} is too long: a holder cut off from the "
            f"server learns it after up to {interval + timeout:g}s, but the server may "
            f"free its lock {SERVER_KEEPALIVE_DEADLINE:g}s after the link breaks. "
            "Expected lock_watch_interval + lock_db_timeout <= "
            f"{SERVER_KEEPALIVE_DEADLINE - LOSS_MARGIN:g}."
        )

    if "lock_args" in attributes and "lock_id" in attributes:
        raise exceptions.ConfigurationError(
            f"Task {task_name!r}: set only one of lock_args and lock_id; each one "
            "defines the whole key."
        )
    lock_args = _valid_lock_args(task_name, attributes.get("lock_args", ()), parameters)
    fixed_key: keys.LockKey | None = None
    if "lock_id" in attributes:
        fixed_key = keys.explicit_key(
            lock_name, attributes["lock_id"], where=f"Task {task_name!r}: lock_id"
        )
    elif not lock_args:
        fixed_key = keys.make_key(values["namespace"], lock_name)
    return options.LockConfig(
        task_name=task_name,
        name=lock_name,
        lock_args=lock_args,
        fixed_key=fixed_key,
        limit=limit,
        **values,
    )


def _fail(
    task_name: str, option: str, value: object, expected: str
) -> exceptions.ConfigurationError:
    return exceptions.ConfigurationError(
        f"Task {task_name!r}: {option}={value!r} is invalid; expected {expected}."
    )


def _valid_lock_args(
    task_name: str, value: object, parameters: Sequence[inspect.Parameter]
) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        expected = "a parameter name or a tuple of parameter names"
        raise _fail(task_name, "lock_args", value, expected)
    by_name = {parameter.name: parameter for parameter in parameters}
    for name in names:
        parameter = by_name.get(name) if isinstance(name, str) else None
        if parameter is None:
            expected = f"names of the task's parameters ({', '.join(by_name) or 'it takes none'}); {name!r} is not one of them"
            raise _fail(task_name, "lock_args", value, expected)
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            expected = f"named parameters; {name!r} is a *args/**kwargs catch-all, (override lock_key_for for keys that are not plain arguments)"
            raise _fail(task_name, "lock_args", value, expected)
    if len(set(names)) != len(names):
        raise _fail(task_name, "lock_args", value, "each parameter name at most once")
    return tuple(names)
