"""Credentials kept out of what elastic prints, raises and records.

`storage_options` (checkpoint storage, Parquet data) may hold credentials (`key`, `secret`,
`token`, `password`, `client_kwargs.aws_secret_access_key`...), and a URI may carry them as
`scheme://user:password@host`. Nothing elastic writes for people or for later (events, error
messages, `elastic status`, the job's repr) may show them. Two pure tools:

* `redact(obj)`: a copy with the value of every secret-looking key replaced by "***", at any
  depth, and the password part of any URI in a string hidden. Knows names, not values.
* `scrub(obj, values)`: `redact`, plus every occurrence of a known secret value in any string
  replaced, for text that quotes a credential without its key (an exception's message).
  `secret_values(options, uri)` collects those values from a job's storage settings: the secret
  ones only. An access key id (s3fs's `key`, `aws_access_key_id`, a URI's user) is an identifier
  (S3 puts it in every presigned URL and its own error messages): masked where it is a setting,
  never searched for in text, where its value ("elastic", say) may be a bucket's name too, and a
  checkpoint's URI in an event must stay that URI.

The job sent to the controller and the workers still carries `storage_options` as given (they
need it to open storage); hence the advice to give credentials through the environment or the
platform's identity instead (docs/guarantees.md#credentials-and-what-is-redacted).
"""
from __future__ import annotations

import re
from typing import Any, Iterable

MASK = "***"

# A key is secret-looking when one of its words (split on _ - . and camelCase) is one of these:
# "key" covers key, aws_access_key_id, account_key, private_key, api_key, AccountKey.
_SECRET_WORDS = frozenset({"key", "secret", "token", "password", "passwd", "pwd", "credential", "credentials",
                           "auth", "authorization", "signature", "sas", "cookie", "apikey", "passphrase"})
_SECRET_NAMES = frozenset({"connection_string", "connectionstring"})  # Azure's holds the account key
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD_SPLIT = re.compile(r"[_\-.\s]+")
# scheme://user:password@host: the userinfo is hidden whole (its user is often an access key id).
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://)[^/@\s:]*:[^/@\s]*@")
MIN_SECRET_LEN = 4  # shorter values are not searched for in text: "1" would mangle every number
# Settings whose value identifies a credential rather than being one: masked, not searched for.
_IDENTIFIER_NAMES = frozenset({"key", "access_key", "access_key_id", "aws_access_key_id", "accesskey",
                               "accesskeyid", "key_id", "keyid"})


def is_secret_key(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    if name.lower() in _SECRET_NAMES:
        return True
    words = _WORD_SPLIT.split(_CAMEL.sub("_", name).lower())
    return any(w in _SECRET_WORDS for w in words)


def redact_uri(text: str) -> str:
    """`s3://AKIA...:secret@bucket/x` -> `s3://***@bucket/x`; text without credentials unchanged."""
    return _USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)


def redact(obj: Any) -> Any:
    """A copy of `obj` (dicts, lists, tuples, strings; anything else as is) with the value of every
    secret-looking key replaced by "***" and URI passwords hidden. A None value stays None."""
    if isinstance(obj, dict):
        return {k: (MASK if is_secret_key(k) and v is not None else redact(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v) for v in obj)
    if isinstance(obj, str):
        return redact_uri(obj)
    return obj


def secret_values(*sources: Any) -> frozenset[str]:
    """The credentials in `sources` (storage options, URIs), as strings to search text for: every
    string under a secret-looking key that is not an identifier's, at any depth, and the password
    of URIs."""
    found: set[str] = set()

    def walk(obj: Any, secret: bool) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                identifier = isinstance(k, str) and _CAMEL.sub("_", k).lower() in _IDENTIFIER_NAMES
                walk(v, (secret or is_secret_key(k)) and not identifier)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                walk(v, secret)
        elif isinstance(obj, str):
            if secret:
                found.add(obj)
            for m in _USERINFO.finditer(obj):  # the password only: the user is an identifier
                found.update(m.group(0)[len(m.group(1)):-1].split(":", 1)[1:])
        elif secret and isinstance(obj, (int, float)) and not isinstance(obj, bool):
            found.add(str(obj))

    for s in sources:
        walk(s, False)
    return frozenset(v for v in found if len(v) >= MIN_SECRET_LEN)


def scrub(obj: Any, values: Iterable[str] = ()) -> Any:
    """`redact(obj)`, and every occurrence of one of `values` in any string (keys included)
    replaced by "***". Longest first, so a secret that contains another goes whole."""
    values = sorted(set(values), key=len, reverse=True)

    def text(s: str) -> str:
        for v in values:
            if v in s:
                s = s.replace(v, MASK)
        return redact_uri(s)

    def walk(o: Any) -> Any:
        if isinstance(o, dict):
            return {(text(k) if isinstance(k, str) else k): (MASK if is_secret_key(k) and v is not None else walk(v))
                    for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(walk(v) for v in o)
        if isinstance(o, str):
            return text(o)
        return o

    return walk(obj)


def job_secrets(job: Any) -> frozenset[str]:
    """The credential values of a `JobConfig`: its checkpoint storage's and its Parquet data's."""
    ck, data = job.checkpoint, job.train.data
    return secret_values(ck.storage_options, ck.storage_uri,
                         *((data.storage_options, data.uri) if data is not None else ()))


def named_secrets(job: Any) -> list[str]:
    """Where a job carries credentials inline (for the warning that recommends the environment):
    `checkpoint.storage_options.secret`, ... (names, never values)."""
    out: list[str] = []

    def walk(obj: Any, where: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if is_secret_key(k) and v not in (None, ""):
                    out.append(f"{where}.{k}")
                else:
                    walk(v, f"{where}.{k}")

    walk(job.checkpoint.storage_options, "checkpoint.storage_options")
    if job.train.data is not None:
        walk(job.train.data.storage_options, "train.data.storage_options")
    for field, uri in (("checkpoint.storage_uri", job.checkpoint.storage_uri),
                       ("train.data.uri", job.train.data.uri if job.train.data is not None else "")):
        if redact_uri(uri) != uri:
            out.append(field)
    return out
