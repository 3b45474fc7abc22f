"""Secrets never leave through a URL or an error text: hostile URL shapes, table-driven.

Every secret below contains the marker ``LEAK`` (or ``leak``); the one assertion that
matters is that the marker never appears in what we would log, raise or print.
"""

from __future__ import annotations

import re
import traceback

import psycopg2
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_pglock import ConfigurationError, DatabaseError
from celery_pglock.db import driver_errors, engines, redact

MARKER = re.compile("leak", re.IGNORECASE)

#: (url, what the masked form must be, or None to check only that nothing leaks)
HOSTILE_URLS = [
    # an unescaped "@" in the password: split at the first "@" by SQLAlchemy and libpq
    ("postgresql://app:p@ssLEAKME@db/x", "postgresql://***:***@***/***"),
    ("postgresql+psycopg2://app:LEAK@@db/x", None),
    ("postgresql://app:@LEAK@db/x", None),
    ("postgresql://app:p@ssLEAK@db:5432/x?sslmode=require", None),
    ("postgresql://app@LEAK@db/x", None),  # "@" typed for ":"
    ("postgresql://app:p?LEAK@x@db/x", None),  # a "?" hides the first "@"
    # other unescaped delimiters in the password
    ("postgresql://app:p:LEAK@db/x", "postgresql://app:***@db/x"),
    ("postgresql://app:p/LEAK@db/x", "postgresql://app:***@db/x"),
    ("postgresql://app:p?LEAK@db/x", "postgresql://app:***@db/x"),
    ("postgresql://app:p#LEAK@db/x", "postgresql://app:***@db/x"),
    ("postgresql://app:p%LEAK@db/x", "postgresql://app:***@db/x"),
    ("postgresql://app:p%40LEAK@db/x", "postgresql://app:***@db/x"),  # escaped: fine
    ("postgresql://app:p LEAK@db/x", "postgresql://app:***@db/x"),
    ("postgresql://app:LEAK\n@db/x", "postgresql://app:***@db/x"),
    # a "/" in the user name makes the parser see no userinfo at all
    ("postgresql://ap/p:LEAK@db/x", "postgresql://ap/***"),
    # secrets in the query string, in any case and percent-encoded names
    ("postgresql://app@db/x?password=LEAK", "postgresql://app@db/x?password=***"),
    ("postgresql://app@db/x?PassWord=LEAK&sslmode=require", None),
    ("postgresql://app@db/x?pass%77ord=LEAK", "postgresql://app@db/x?password=***"),
    ("postgresql://app@db/x?sslpassword=LEAK&sslkey=/k", None),
    ("postgresql://app@db/x?password=a&password=LEAK", None),
    ("postgresql://app@db/x?dsn=host%3Ddb%20password%3DLEAK", None),
    ("postgresql://app@db/x?options=-c%20app.token%3DLEAK", None),
    ("postgresql://app@db/x?sslmode=require;password=LEAK", None),
    ("postgresql://app@db/x?mytoken=LEAK", "postgresql://app@db/x?***=***"),
    (
        "postgresql://app@db/x?password=a&LEAK=b",
        "postgresql://app@db/x?password=***&***=***",
    ),
    ("postgresql://app@db/x?p%40LEAK=1", None),
    (
        "postgresql:///x?host=/tmp&password=LEAK",
        "postgresql:///x?host=/tmp&password=***",
    ),
    # malformed: whatever the parser makes of them, nothing of the secret shows
    ("postgresql://app:LEAK@db:54x/x", "postgresql://***"),
    ("postgresql://app:LEAK", None),
    ("postgresql://app:LEAK@", "postgresql://app:***@"),
    ("postgresql://app:LEAK@db/x#frag", None),
    ("postgresql://app:LEAK@db/x y", None),
    ("postgresql:/app:LEAK@db/x", "<unparseable database URL>"),
    ("postgresql//app:LEAK@db/x", "<unparseable database URL>"),
    ("app:LEAK@db/x", "<unparseable database URL>"),
    ("://app:LEAK@db", "<unparseable database URL>"),
    ("pg sql://app:LEAK@db", "<unparseable database URL>"),
    ("", "<unparseable database URL>"),
    # libpq key=value strings
    (
        "host=db user=app password=LEAK dbname=x",
        "host=db user=app password=*** dbname=x",
    ),
    ("host=db password='LE AK' dbname=x", "host=db password=*** dbname=x"),
    ("host=db password = LEAK", "host=db password=***"),
    ("host=db LEAK", "<unparseable database URL>"),
    ("host=db options='-c x=LEAK'", "host=db options=***"),
    # other schemes this library logs (brokers)
    ("redis://:LEAK@127.0.0.1:6379/6", "redis://:***@127.0.0.1:6379/6"),
    ("amqp://guest:LEAK@rabbit:5672//", "amqp://guest:***@rabbit:5672//"),
]

#: Well-formed URLs keep everything an operator needs to recognise the database.
READABLE_URLS = [
    (
        "postgresql+psycopg2://postgres@127.0.0.1:5432/test",
        "postgresql+psycopg2://postgres@127.0.0.1:5432/test",
    ),
    (
        "postgresql://app:pw@engines.example.com/x",
        "postgresql://app:***@engines.example.com/x",
    ),
    (
        "postgresql://app%40srv:pw@[::1]:5432/x",
        "postgresql://app%40srv:***@[::1]:5432/x",
    ),
    (
        "postgresql://app@db/x?sslmode=require&application_name=w%201",
        "postgresql://app@db/x?sslmode=require&application_name=w%201",
    ),
    (
        sa.URL.create("postgresql+psycopg2", "app", "p@ss:/", "db", 5432, "x"),
        "postgresql+psycopg2://app:***@db:5432/x",
    ),
]


@pytest.mark.parametrize(("url", "expected"), HOSTILE_URLS)
def test_hostile_urls_never_show_the_secret(url, expected):
    """Whatever the shape, the masked form holds no part of the secret."""
    masked = engines.mask_url(url)
    assert not MARKER.search(masked), masked
    if expected is not None:
        assert expected == masked


@pytest.mark.parametrize(("url", "expected"), READABLE_URLS)
def test_well_formed_urls_stay_readable(url, expected):
    """Scheme, user, host, port, database and harmless options are shown."""
    assert expected == engines.mask_url(url)


#: Pieces a hostile password is made of: the marker and every URL delimiter.
_PIECES = st.sampled_from(
    [
        "LEAK",
        "@",
        ":",
        "/",
        "?",
        "#",
        "%",
        "%40",
        "&",
        "=",
        "+",
        " ",
        "'",
        '"',
        "[",
        "]",
    ]
)
_PASSWORDS = (
    st.lists(_PIECES, min_size=1, max_size=12)
    .map("".join)
    .filter(lambda text: "LEAK" in text)
)


@settings(max_examples=300, deadline=None)
@given(
    password=_PASSWORDS,
    tail=st.sampled_from(["@db/x", "@db:5432/x?sslmode=require", "@db"]),
)
def test_any_unescaped_password_is_masked(password, tail):
    """A password made of any URL delimiters, unescaped, is never shown."""
    assert "LEAK" not in engines.mask_url(f"postgresql://app:{password}{tail}")


@settings(max_examples=200, deadline=None)
@given(
    value=_PASSWORDS,
    name=st.sampled_from(["password", "sslpassword", "dsn", "options", "x"]),
)
def test_any_secret_query_value_is_masked(value, name):
    """Query values are shown only for allow-listed options with plain values."""
    assert "LEAK" not in engines.mask_url(f"postgresql://app@db/x?{name}={value}")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:p@ssLEAKME@db/x",
        "postgresql+psycopg2://app:LEAK@@db/x",
        "postgresql://app@LEAK@db/x",
        "postgresql://app:p?LEAK@x@db/x",
    ],
)
def test_ambiguous_userinfo_is_refused_without_the_secret(url):
    """An unescaped "@" would connect to a host made of half the password: refused."""
    with pytest.raises(ConfigurationError) as caught:
        engines.check_url(url)
    message = str(caught.value)
    assert "%40" in message
    assert "pglock_database_url" in message
    assert not MARKER.search(message)


@pytest.mark.parametrize(
    "url",
    ["postgresql://app:LEAK@db:54x/x", "postgresql://app:LEAK", "mysql://u:LEAK@h/db"],
)
def test_invalid_urls_are_refused_without_the_secret(url):
    """A bad port (ValueError inside SQLAlchemy) or scheme is a ConfigurationError."""
    with pytest.raises(ConfigurationError) as caught:
        engines.check_url(url)
    assert not MARKER.search(str(caught.value))


def test_engine_options_that_are_not_a_dict_are_not_echoed():
    """pglock_engine_options set to a DSN string by mistake is named by type only."""
    with pytest.raises(ConfigurationError) as caught:
        engines.create_engine(
            "postgresql://app@db/x",
            {"pglock_engine_options": "postgresql://app:LEAK@db/x"},
        )
    assert "pglock_engine_options" in str(caught.value)
    assert not MARKER.search(str(caught.value))


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ('could not translate host name "ssLEAKME@db" to address', ["ssLEAKME"]),
        ("connecting to postgresql://app:LEAK@db/x failed", []),
        ("invalid dsn: host=db password=LEAK dbname=x", []),
        ("invalid dsn: host=db password='LE AK' dbname=x", []),
        ('{"password": "LEAK"}', []),
        ("the password is LEAK", ["LEAK"]),
        ("the password is leak.", ["leak"]),  # short secrets: whole words only
    ],
)
def test_scrub_text_removes_urls_pairs_and_known_secrets(text, secrets):
    assert not MARKER.search(redact.scrub_text(text, secrets))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "lock on postgresql://postgres@127.0.0.1:5432/postgres: server closed",
            "lock on postgresql://postgres@127.0.0.1:5432/postgres: server closed",
        ),
        ("(see postgresql://app:LEAK@db/x).", "(see postgresql://app:***@db/x)."),
        # After a query, trailing punctuation may belong to a secret: masked with it.
        ("postgresql://app@db/x?password=LEAK.", "postgresql://app@db/x?password=***"),
    ],
)
def test_scrub_text_keeps_the_punctuation_after_a_url(text, expected):
    """A URL at the end of a clause keeps its database name readable."""
    assert redact.scrub_text(text) == expected


def test_short_secrets_do_not_garble_messages():
    """A one-letter password is removed as a word, not from every word."""
    assert "password p*** ***" != redact.scrub_text("password p wrong", ["p"])
    assert "user pat: *** wrong" == redact.scrub_text("user pat: p wrong", ["p"])


def test_wrap_db_errors_scrubs_the_whole_chain():
    """The DatabaseError and every chained driver error lose the secret, in place."""
    engine = sa.create_engine("postgresql+psycopg2://app:p@ssLEAKME@db/x")
    driver_error = psycopg2.OperationalError(
        'could not translate host name "ssLEAKME@db" to address'
    )
    wrapped = sa.exc.OperationalError("connect", {}, driver_error)
    wrapped.__cause__ = driver_error
    with (
        pytest.raises(DatabaseError) as caught,
        driver_errors.wrap_db_errors("connect", engine),
    ):
        raise wrapped
    rendered = "".join(traceback.format_exception(caught.value))
    assert "Could not connect" in rendered
    assert "could not translate host name" in rendered
    assert not MARKER.search(rendered), rendered
    assert isinstance(caught.value.__cause__.orig, psycopg2.OperationalError)
