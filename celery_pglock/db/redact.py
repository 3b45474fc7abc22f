"""Redaction: database URLs and driver error texts made safe to log. Pure functions.

Readers parse a malformed URL differently (an unescaped ``@`` in the password), so
:func:`mask_url` may hide too much, never too little. Why: docs/operations/security.md
("Passwords: what is masked, and where").
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING
from urllib.parse import quote

from sqlalchemy.engine import make_url

if TYPE_CHECKING:
    from collections.abc import Iterable

    import sqlalchemy as sa

MASK = "***"
UNPARSEABLE = "<unparseable database URL>"

#: URL query / conninfo options whose values are shown: libpq options that never carry
#: a secret. Any other value is masked.
SAFE_OPTIONS = frozenset(
    "application_name channel_binding client_encoding connect_timeout dbname "  # noqa: SIM905 - a list is 30 lines
    "fallback_application_name gssencmode host hostaddr keepalives keepalives_count "
    "keepalives_idle keepalives_interval krbsrvname load_balance_hosts port replication "
    "requirepeer service ssl_max_protocol_version ssl_min_protocol_version sslcert "
    "sslcompression sslcrl sslmode sslnegotiation sslrootcert target_session_attrs "
    "tcp_user_timeout user".split()
)

#: Options whose names are shown, values masked. Other names are masked too: an unknown
#: name may be a piece of a password split at an unescaped "&".
SECRET_OPTIONS = frozenset(
    {"dsn", "options", "passfile", "password", "sslkey", "sslpassword"}
)
#: Characters of a component that is shown; anything else is masked.
_SAFE_SCHEME = re.compile(r"[A-Za-z][\w+.\-]*")
_SAFE_USER = re.compile(r"[\w.\-+@]+")  # '@' only from %40: see ambiguous_userinfo()
_SAFE_HOST = re.compile(r"[\w.\-]+|[0-9A-Fa-f:.%]+")  # a name, an IPv4 or IPv6 address
_SAFE_DATABASE = re.compile(r"[\w.\-$/]*")
_SAFE_NAME = re.compile(r"[A-Za-z_]\w*")
_SAFE_VALUE = re.compile(r"[\w.\-/:,@+ ]*")
#: One ``key=value`` of a libpq conninfo string (value bare or single-quoted).
_CONNINFO_ITEM = re.compile(r"\s*(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|[^\s']*)")
#: Anything URL-shaped inside free text (a driver error, a traceback).
_URL_IN_TEXT = re.compile(r"[A-Za-z][\w+.\-]*://[^\s\"'<>]*")
_TRAILING_PUNCTUATION = ".,:;)]"
#: ``password=...``-like pairs inside free text, quoted or not.
_SECRET_PAIR_IN_TEXT = re.compile(
    r"(?i)\b(\w*(?:pass|pwd|secret|token|dsn|credential)\w*)([\"']?\s*[=:]\s*)"
    r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s,;&)]+)"
)
#: Secrets shorter than this are scrubbed from free text only as whole words, so that a
#: one-letter password does not turn every "p" of an error message into "***".
_SHORT_SECRET = 4


def mask_url(url: str | sa.URL | None) -> str:
    """Render a database (or broker) URL with every secret replaced by ``***``: safe to log.

    Shows the scheme, user name, host, port, database and allow-listed query options
    when each is unambiguous; masks the password, every other query value, and any
    component that a malformed URL makes ambiguous (an unescaped ``@`` in the password).
    A libpq ``key=value`` string is masked the same way; anything else becomes
    ``<unparseable database URL>``.
    """
    if url is None:
        return UNPARSEABLE
    text = url if isinstance(url, str) else url.render_as_string(hide_password=False)
    try:
        scheme, separator, rest = text.partition("://")
        if separator:
            return _mask_url(scheme, rest)
        return _mask_conninfo(text)
    except Exception:  # any surprise: show nothing rather than something raw
        return UNPARSEABLE


def ambiguous_userinfo(url: str) -> bool:
    """True if ``url`` has more than one literal ``@`` anywhere (a password may hold ``?``
    and ``/``): its user/password split is a guess (SQLAlchemy and libpq split at the
    first one, and a second ``@`` then parses into the host)."""
    return url.partition("://")[2].count("@") > 1


def secrets_of(url: sa.URL) -> list[str]:
    """The strings of a parsed URL that must never appear in text we log or raise."""
    found = [url.password] if isinstance(url.password, str) else []
    # An ambiguous split: what the parser took for the host, user or database holds
    # the rest of a password (host "ss@db" from "app:p@ss@db": "ss" is secret, "db"
    # is the real host and stays readable in "could not translate host name").
    if url.host and "@" in url.host:
        found.append(url.host.rpartition("@")[0])
    for part in (url.username, url.database):
        if part and "@" in part:
            found.extend(piece for piece in re.split(r"[@:/]", part) if piece)
    found += [v for name, v in _query(url) if v and name.lower() not in SAFE_OPTIONS]
    return found


def scrub_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL masked, ``password=...`` pairs masked and ``secrets`` removed."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        if len(secret) >= _SHORT_SECRET:
            text = text.replace(secret, MASK)
        else:
            text = re.sub(rf"(?<!\w){re.escape(secret)}(?!\w)", MASK, text)
    text = _URL_IN_TEXT.sub(_mask_url_in_text, text)
    return _SECRET_PAIR_IN_TEXT.sub(
        lambda match: f"{match.group(1)}{match.group(2)}{MASK}", text
    )


def scrub_exception(exc: BaseException, secrets: Iterable[str] = ()) -> None:
    """Scrub the string ``args`` of ``exc`` and of every exception chained to it, in place
    (tracebacks print the whole chain); types and attributes stay."""
    secrets = list(secrets)
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        # An exception type with read-only args keeps them.
        with contextlib.suppress(AttributeError, TypeError):
            current.args = tuple(
                scrub_text(arg, secrets) if isinstance(arg, str) else arg
                for arg in current.args
            )
        pending += [current.__cause__, current.__context__]
        orig = getattr(current, "orig", None)  # SQLAlchemy's DBAPIError
        if isinstance(orig, BaseException):
            pending.append(orig)


def _mask_url_in_text(match: re.Match[str]) -> str:
    # Keep the punctuation after its path, not after a query (part of a secret value?).
    url = match.group(0)
    core = url.rstrip(_TRAILING_PUNCTUATION)
    if "?" in core or core == url:
        return mask_url(url)
    return mask_url(core) + url[len(core) :]


def _query(url: sa.URL) -> list[tuple[str, str]]:
    # A repeated name has a tuple of values.
    return [
        (name, value)
        for name, values in url.query.items()
        for value in (values if isinstance(values, tuple) else (values,))
    ]


def _mask_url(scheme: str, rest: str) -> str:
    if not _SAFE_SCHEME.fullmatch(scheme):
        return UNPARSEABLE
    try:
        parsed = make_url(f"{scheme}://{rest}")
    except Exception:  # a bad port or an unparseable shape: show only the scheme
        return f"{scheme}://{MASK}"
    ambiguous = ambiguous_userinfo(f"{scheme}://{rest}")
    userinfo = ""
    if parsed.username is not None or parsed.password is not None:
        user = parsed.username or ""
        if ambiguous or not (user == "" or _SAFE_USER.fullmatch(user)):
            user = MASK
        else:
            user = quote(user, safe="")  # a user "app@srv" came as app%40srv
        userinfo = f"{user}:{MASK}@" if parsed.password is not None else f"{user}@"
    host = parsed.host or ""
    if host and (ambiguous or not _SAFE_HOST.fullmatch(host)):
        host = MASK
    elif ":" in host:
        host = f"[{host}]"
    port = f":{parsed.port}" if parsed.port is not None else ""
    database = ""
    if parsed.database is not None:
        shown = _SAFE_DATABASE.fullmatch(parsed.database) and not ambiguous
        database = "/" + (parsed.database if shown else MASK)
    query = _mask_options(_query(parsed))
    return f"{scheme}://{userinfo}{host}{port}{database}" + (
        f"?{'&'.join(query)}" if query else ""
    )


def _mask_conninfo(text: str) -> str:
    items: list[tuple[str, str]] = []
    position = 0
    stripped = text.strip()
    while position < len(stripped):
        match = _CONNINFO_ITEM.match(stripped, position)
        if match is None or match.end() == position:
            return UNPARSEABLE
        items.append((match.group(1), match.group(2)))
        position = match.end()  # the next item's \s* skips the blanks in between
    if not items:
        return UNPARSEABLE
    return " ".join(_mask_options(items))


def _mask_options(items: Iterable[tuple[str, str]]) -> list[str]:
    shown = []
    for name, value in items:
        safe = name.lower() in SAFE_OPTIONS and _SAFE_VALUE.fullmatch(value)
        known = name.lower() in SAFE_OPTIONS or name.lower() in SECRET_OPTIONS
        label = name if known and _SAFE_NAME.fullmatch(name) else MASK
        shown.append(f"{label}={quote(value, safe='/:,@') if safe else MASK}")
    return shown
