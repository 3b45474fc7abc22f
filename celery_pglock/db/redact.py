"""Database URLs and driver error texts made safe to log; may hide too much, never too little.
Why: docs/operations/security.md ("Passwords: what is masked, and where")."""

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

#: libpq options whose values are shown (never a secret); any other value is masked.
SAFE_OPTIONS = frozenset(
    "application_name channel_binding client_encoding connect_timeout dbname "  # noqa: SIM905 - a list is 30 lines
    "fallback_application_name gssencmode host hostaddr keepalives keepalives_count "
    "keepalives_idle keepalives_interval krbsrvname load_balance_hosts port replication "
    "requirepeer service ssl_max_protocol_version ssl_min_protocol_version sslcert "
    "sslcompression sslcrl sslmode sslnegotiation sslrootcert target_session_attrs "
    "tcp_user_timeout user".split()
)

#: Names shown, values masked. Unknown names are masked: maybe a password split at "&".
SECRET_OPTIONS = frozenset(
    {"dsn", "options", "passfile", "password", "sslkey", "sslpassword"}
)
_SAFE_SCHEME = re.compile(r"[A-Za-z][\w+.\-]*")
_SAFE_USER = re.compile(r"[\w.\-+@]+")  # '@' only from %40: see ambiguous_userinfo()
_SAFE_HOST = re.compile(r"[\w.\-]+|[0-9A-Fa-f:.%]+")  # a name, an IPv4 or IPv6 address
_SAFE_DATABASE = re.compile(r"[\w.\-$/]*")
_SAFE_NAME = re.compile(r"[A-Za-z_]\w*")
_SAFE_VALUE = re.compile(r"[\w.\-/:,@+ ]*")
_CONNINFO_ITEM = re.compile(r"\s*(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|[^\s']*)")
_URL_IN_TEXT = re.compile(r"[A-Za-z][\w+.\-]*://[^\s\"'<>]*")
_TRAILING_PUNCTUATION = ".,:;)]"
_SECRET_PAIR_IN_TEXT = re.compile(
    r"(?i)\b(\w*(?:pass|pwd|secret|token|dsn|credential)\w*)([\"']?\s*[=:]\s*)"
    r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s,;&)]+)"
)
#: Shorter secrets are scrubbed as whole words only (a password "p" spares every other "p").
_SHORT_SECRET = 4


def mask_url(url: str | sa.URL | None) -> str:
    """Render a database (or broker) URL with every secret replaced by ``***``: safe to log.

    Shows the scheme, user, host, port, database and allow-listed query options when
    unambiguous; masks the password, other query values, and any component a malformed
    URL makes ambiguous (an unescaped ``@``). A libpq ``key=value`` string is masked the
    same way; anything else becomes ``<unparseable database URL>``.
    """
    if url is None:
        return UNPARSEABLE
    text = url if isinstance(url, str) else url.render_as_string(hide_password=False)
    try:
        scheme, separator, rest = text.partition("://")
        return _mask_url(scheme, rest) if separator else _mask_conninfo(text)
    except Exception:  # show nothing rather than something raw
        return UNPARSEABLE


def ambiguous_userinfo(url: str) -> bool:
    """More than one ``@`` anywhere (a password may hold ``?`` and ``/``): a guessed split."""
    return url.partition("://")[2].count("@") > 1


def secrets_of(url: sa.URL) -> list[str]:
    """Strings of ``url`` never to appear in text we log or raise."""
    found = [url.password] if isinstance(url.password, str) else []
    # An ambiguous split: host "ss@db" from "app:p@ss@db" hides "ss"; "db" stays readable.
    if url.host and "@" in url.host:
        found.append(url.host.rpartition("@")[0])
    for part in (url.username, url.database):
        if part and "@" in part:
            found.extend(piece for piece in re.split(r"[@:/]", part) if piece)
    found += [v for name, v in _query(url) if v and name.lower() not in SAFE_OPTIONS]
    return found


def scrub_text(text: str, secrets: Iterable[str] = ()) -> str:
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
    """In place, the string ``args`` of the whole chain (tracebacks print it all)."""
    secrets = list(secrets)
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        with contextlib.suppress(AttributeError, TypeError):  # read-only args: kept
            current.args = tuple(
                scrub_text(arg, secrets) if isinstance(arg, str) else arg
                for arg in current.args
            )
        pending += [current.__cause__, current.__context__]
        orig = getattr(current, "orig", None)  # SQLAlchemy's DBAPIError
        if isinstance(orig, BaseException):
            pending.append(orig)


def _mask_url_in_text(match: re.Match[str]) -> str:
    # Punctuation after a path is kept; after a query it may be part of a secret.
    url = match.group(0)
    core = url.rstrip(_TRAILING_PUNCTUATION)
    if "?" in core or core == url:
        return mask_url(url)
    return mask_url(core) + url[len(core) :]


def _query(url: sa.URL) -> list[tuple[str, str]]:
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
    except Exception:  # a bad port or shape: show only the scheme
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
        position = match.end()
    return " ".join(_mask_options(items)) if items else UNPARSEABLE


def _mask_options(items: Iterable[tuple[str, str]]) -> list[str]:
    shown = []
    for name, value in items:
        safe = name.lower() in SAFE_OPTIONS and _SAFE_VALUE.fullmatch(value)
        known = name.lower() in SAFE_OPTIONS or name.lower() in SECRET_OPTIONS
        label = name if known and _SAFE_NAME.fullmatch(name) else MASK
        shown.append(f"{label}={quote(value, safe='/:,@') if safe else MASK}")
    return shown
