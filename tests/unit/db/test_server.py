"""ServerFacts.refusal: which scope is refused where, and what the message names."""

from __future__ import annotations

import pytest

from celery_pglock.config import LockScope
from celery_pglock.db.server_probe import Pooling, ServerFacts

URL = "postgresql+psycopg2://app:***@pooler:6432/app"


def facts(pooling=Pooling.NONE, *, is_standby=False):
    return ServerFacts(
        server_version="18.1",
        server_version_num=180001,
        is_standby=is_standby,
        pooling=pooling,
        proxied=True,
        evidence="two client connections were both served by backend pid 7",
        masked_url=URL,
    )


@pytest.mark.parametrize(
    ("pooling", "session_refused", "transaction_refused"),
    [
        (Pooling.NONE, False, False),
        (Pooling.TRANSACTION, True, False),
        (Pooling.STATEMENT, True, True),
    ],
)
def test_refused_scopes_per_pooling_mode(pooling, session_refused, transaction_refused):
    found = facts(pooling)
    assert session_refused == (found.refusal(LockScope.SESSION) is not None)
    assert transaction_refused == (found.refusal("transaction") is not None)


def test_transaction_pooling_message_names_both_fixes_and_the_evidence():
    message = facts(Pooling.TRANSACTION).refusal("session")
    assert message is not None
    assert "lock_scope='transaction'" in message
    assert "pglock_scope" in message
    assert "pglock_database_url" in message
    assert "session pooling" in message
    assert "backend pid 7" in message
    assert URL in message


def test_statement_pooling_message_names_the_url_setting():
    message = facts(Pooling.STATEMENT).refusal("transaction")
    assert message is not None
    assert "statement-pooling" in message
    assert "pglock_database_url" in message


@pytest.mark.parametrize("scope", list(LockScope))
@pytest.mark.parametrize("pooling", list(Pooling))
def test_standby_is_refused_whatever_the_scope_and_pooling(scope, pooling):
    message = facts(pooling, is_standby=True).refusal(scope)
    assert message is not None
    assert "standby" in message
    assert "target_session_attrs=read-write" in message
