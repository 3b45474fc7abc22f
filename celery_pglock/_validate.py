"""Checks of one task option's value, for config.resolve.

Each raises an error naming the task, the option and what was expected: ``Task 'x':
lock_retry_delay=-1 is invalid; expected a positive number of seconds.``
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions

if TYPE_CHECKING:
    import enum
    import inspect
    from collections.abc import Sequence


def fail(
    task_name: str, option: str, value: object, expected: str
) -> exceptions.ConfigurationError:
    return exceptions.ConfigurationError(
        f"Task {task_name!r}: {option}={value!r} is invalid; expected {expected}."
    )


def choice(
    task_name: str, option: str, value: object, enum_cls: type[enum.Enum]
) -> Any:
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum_cls)
        raise fail(task_name, option, value, f"one of {allowed}") from None


def seconds(task_name: str, option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise fail(task_name, option, value, "a positive number of seconds")
    if value == float("inf"):
        raise fail(
            task_name,
            option,
            value,
            "a finite number of seconds (waits are always bounded)",
        )
    return float(value)


def lock_args(
    task_name: str, value: object, parameters: Sequence[inspect.Parameter]
) -> tuple[str, ...]:
    names: tuple[object, ...]
    if isinstance(value, str):
        names = (value,)
    elif isinstance(value, (list, tuple)):
        names = tuple(value)
    else:
        raise fail(
            task_name,
            "lock_args",
            value,
            "a parameter name or a tuple of parameter names",
        )
    by_name = {parameter.name: parameter for parameter in parameters}
    for name in names:
        parameter = by_name.get(name) if isinstance(name, str) else None
        if parameter is None:
            raise fail(
                task_name,
                "lock_args",
                value,
                f"names of the task's parameters ({', '.join(by_name) or 'it takes none'}); "
                f"{name!r} is not one of them",
            )
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise fail(
                task_name,
                "lock_args",
                value,
                f"named parameters; {name!r} is a *args/**kwargs catch-all, use lock_key instead",
            )
    if len(set(names)) != len(names):
        raise fail(task_name, "lock_args", value, "each parameter name at most once")
    return tuple(str(name) for name in names)
