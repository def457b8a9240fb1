"""Secrets kept out of error messages and log lines.

How it works: a `Redactor` holds the secret values specroute knows of -- the settings in
`SECRET_FIELDS`, wherever they came from (file, environment) -- and replaces each occurrence
in a text with `MASK`. Values are found before they are validated: `secrets_in_yaml` scans a
config file's raw text line by line, so even a file that does not parse (whose YAML error would
quote the offending line) has its secrets known; `secrets_in_env` reads the environment. The
config loader redacts every `ConfigError` it raises with what it found in its own sources, and
`serve` puts a `RedactingFilter` on its log handlers, so no log record -- a reload failure, an
exception's traceback, a third-party library's message -- reaches stderr with a secret in it.

Values shorter than `MIN_SECRET_CHARS` are not searched for: they would turn up by chance in
unrelated text (and such a value is no secret).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import traceback
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

SECRET_FIELDS = ("admin_token", "baseline_api_key", "eagle_api_key")
"""The settings whose values are secrets."""
MASK = "**********"
MIN_SECRET_CHARS = 4

# `key: value` on one line of YAML, the key optionally quoted, anywhere (block or flow style).
_KEYS = "|".join(SECRET_FIELDS)
_YAML_SECRET = re.compile(r"""["']?\b(?:""" + _KEYS + r""")\b["']?\s*:\s*(?P<value>[^\r\n]*)""")
_BLOCK = re.compile(r"^[|>][-+0-9]*\s*(#.*)?$")
# user:password@ in a URL-like text
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)?[^\s/@'\"]+@")


_NOT_A_VALUE = frozenset({"", "~", "null", "Null", "NULL", "true", "false", "True", "False", "|", ">"})


def _candidates(raw: str) -> list[str]:
    """What a secret's raw YAML value may appear as: as written, unquoted, up to a comment or a
    flow delimiter. YAML's null and booleans are no secret (masking "null" would garble logs)."""
    value = raw.strip()
    if value.startswith("#") or value.split(" #", 1)[0].strip() in _NOT_A_VALUE:
        return []
    out = [value]
    for cut in (" #", ",", "}", "]"):
        if cut in value:
            out.append(value.split(cut, 1)[0].strip())
    for v in list(out):
        if len(v) >= 2 and v[0] in "'\"":
            inner = v[1:-1] if v[-1] == v[0] else v[1:]
            out.append(inner)
    return [v for v in out if v not in _NOT_A_VALUE]


def _block_scalar(text: str, start: int) -> list[str]:
    """The lines of a block scalar (`key: |` or `key: >`) that begins after offset `start`."""
    lines = []
    indent: int | None = None
    for line in text[start:].splitlines()[1:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent or depth == 0:
            break
        lines.append(line.strip())
    return lines


def secrets_in_yaml(text: str) -> set[str]:
    """Values given to a secret setting anywhere in a YAML text, parsed or not."""
    found: set[str] = set()
    for m in _YAML_SECRET.finditer(text):
        value = m.group("value")
        if _BLOCK.match(value):
            lines = _block_scalar(text, m.start())
            found.update(lines)
            found.update({" ".join(lines), "\n".join(lines)})
        else:
            found.update(_candidates(value))
    return found


def secrets_in_env(environ: Mapping[str, str], prefix: str = "SPECROUTE_") -> set[str]:
    return {v.strip() for k in SECRET_FIELDS if (v := environ.get(prefix + k.upper(), "")).strip()}


def secrets_in_values(values: Mapping[str, Any]) -> set[str]:
    """The secret settings of a dict of raw or validated values (SecretStr unwrapped)."""
    out: set[str] = set()
    for k in SECRET_FIELDS:
        v = values.get(k)
        if v is None:
            continue
        get = getattr(v, "get_secret_value", None)
        text = get() if callable(get) else v
        if isinstance(text, str) and text.strip():
            out.update({text, text.strip()})
    return out


def mask_userinfo(text: str) -> str:
    """`scheme://user:password@host` -> `scheme://***@host` (in any text)."""
    return _USERINFO.sub(lambda m: (m.group("scheme") or "") + "***@", text)


class Redactor:
    """Replaces known secret values in texts. `add` is safe to call from any thread."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: tuple[str, ...] = ()
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        fresh = {s for s in secrets if len(s) >= MIN_SECRET_CHARS}
        if not fresh.issubset(self._secrets):
            # longest first, so a secret that contains another is masked whole
            self._secrets = tuple(sorted(set(self._secrets) | fresh, key=len, reverse=True))

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def __call__(self, text: str) -> str:
        for s in self._secrets:
            if s in text:
                text = text.replace(s, MASK)
        return text


class RedactingFilter(logging.Filter):
    """A handler filter: the record's message (and traceback) rendered and redacted."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor
        self._formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.redactor:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: let the handler report it as it would
            return True
        clean = self.redactor(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redactor(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redactor(record.stack_info)
        return True


def install(redactor: Redactor, logger: logging.Logger | None = None) -> RedactingFilter:
    """Put a `RedactingFilter` on every handler of `logger` (default: the root logger), and
    redact the tracebacks Python prints itself (an uncaught exception, in any thread)."""
    target = logger or logging.getLogger()
    filt = RedactingFilter(redactor)
    for handler in target.handlers:
        handler.addFilter(filt)

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        sys.stderr.write(redactor("".join(traceback.format_exception(kind, value, tb))))

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is not SystemExit:
            name = args.thread.name if args.thread is not None else "a thread"
            sys.stderr.write(f"Exception in {name}:\n")
            excepthook(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    return filt
