"""Credentials kept out of what elastic prints, raises and records.

`storage_options` (checkpoint storage, Parquet data) may hold credentials (`key`, `secret`,
`token`, `password`, `client_kwargs.aws_secret_access_key`, `headers: {x-api-bearer: ...}`...),
and a URI may carry them as `scheme://user:password@host`. Nothing elastic writes for people or
for later (events, error messages, `elastic status`, the job's repr, the run's config.yaml) may
show them. Under `storage_options` a value is shown only when its key, and every key above it
there, is on an allow-list of settings that say where and how, never who (`endpoint_url`,
`region_name`, `anon`, `client_kwargs`, `config_kwargs.read_timeout`, ...): a credential under a
name nobody foresaw is masked too. Elsewhere, secret-looking key names are masked. Two pure tools:

* `redact(obj)`: a copy with those values replaced by "***", at any depth, and the password part
  of any URI in a string hidden. Knows names, not values.
* `scrub(obj, values)`: `redact`, plus every occurrence of a known secret value in any string
  replaced, for text that quotes a credential without its key (an exception's message).
  `secret_values(options, uri)` collects those values from a job's storage settings: exactly the
  values `redact` masks there. An access key id (s3fs's `key`, `aws_access_key_id`, a URI's user)
  is an identifier (S3 puts it in every presigned URL and its own error messages): masked where it
  is a setting, never searched for in text, where its value ("elastic", say) may be a bucket's
  name too, and a checkpoint's URI in an event must stay that URI.

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
# A masked storage option under a name that does not look secret (a header's value, say) is
# searched for in text only from this length: "json" or "AES256" there would mangle every event
# that says them, and a bearer token or an API key is longer.
MIN_UNNAMED_SECRET_LEN = 8
# Settings whose value identifies a credential rather than being one: masked, not searched for.
_IDENTIFIER_NAMES = frozenset({"key", "access_key", "access_key_id", "aws_access_key_id", "accesskey",
                               "accesskeyid", "key_id", "keyid"})
OPTIONS_FIELD = "storage_options"
# Shown under storage_options: fsspec's and s3fs's settings of where and how (and the botocore
# client and config arguments s3fs passes on through client_kwargs and config_kwargs), none of
# which can hold a credential. Anything else there, a header, a custom client argument, is masked
# with everything under it: a name that does not look secret ("x-api-bearer") may still be one.
SAFE_OPTIONS = frozenset({
    "endpoint_url", "region_name", "anon", "use_ssl", "verify", "requester_pays", "version_aware",
    "cache_regions", "default_block_size", "default_fill_cache", "default_cache_type", "cache_type",
    "use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "asynchronous",
    "max_concurrency", "fixed_upload_size", "auto_mkdir",
    "client_kwargs", "config_kwargs",  # containers: the keys inside are judged one by one
    "connect_timeout", "read_timeout", "retries", "total_max_attempts", "max_attempts", "mode",
    "max_pool_connections", "s3", "addressing_style", "use_accelerate_endpoint", "use_dualstack_endpoint",
})


def is_secret_key(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    if name.lower() in _SECRET_NAMES:
        return True
    words = _WORD_SPLIT.split(_CAMEL.sub("_", name).lower())
    return any(w in _SECRET_WORDS for w in words)


def is_shown_option(name: Any) -> bool:
    """A key under storage_options whose value may be shown (when every key above it may too)."""
    return isinstance(name, str) and name in SAFE_OPTIONS and not is_secret_key(name)


def _masked_options(obj: Any, shown: bool = True) -> Any:
    """storage options with every value not on the allow-list masked, at any depth."""
    if isinstance(obj, dict):
        return {k: _masked_options(v, shown and is_shown_option(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_masked_options(v, shown) for v in obj)
    if obj is None:
        return None
    return redact(obj) if shown else MASK


def _option_leaves(obj: Any, shown: bool = True, identifier: bool = False, named: bool = False):
    """(value, shown, under an identifier's key, under a secret-looking key) for each value in
    storage options."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            ident = isinstance(k, str) and _CAMEL.sub("_", k).lower() in _IDENTIFIER_NAMES
            yield from _option_leaves(v, shown and is_shown_option(k), ident, named or is_secret_key(k))
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from _option_leaves(v, shown, identifier, named)
    else:
        yield obj, shown, identifier, named


def redact_uri(text: str) -> str:
    """`s3://AKIA...:secret@bucket/x` -> `s3://***@bucket/x`; text without credentials unchanged."""
    return _USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)


def redact(obj: Any) -> Any:
    """A copy of `obj` (dicts, lists, tuples, strings; anything else as is) with the value of every
    secret-looking key, and under `storage_options` every value not on the allow-list, replaced
    by "***", and URI passwords hidden. A None value stays None."""
    if isinstance(obj, dict):
        return {k: _redact_item(k, v, redact) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v) for v in obj)
    if isinstance(obj, str):
        return redact_uri(obj)
    return obj


def _redact_item(k: Any, v: Any, walk) -> Any:
    if v is None:
        return None
    if k == OPTIONS_FIELD and isinstance(v, dict):
        return _masked_options(v)
    return MASK if is_secret_key(k) else walk(v)


def secret_values(*sources: Any) -> frozenset[str]:
    """The credentials in `sources` (storage options mappings, URIs), as strings to search text
    for: every value `redact` masks in storage options (a string, or a number's digits), at any
    depth, except an identifier's and those too short to search for (MIN_SECRET_LEN under a
    secret-looking key, MIN_UNNAMED_SECRET_LEN elsewhere); and the password of URIs."""
    found: set[str] = set()
    for source in sources:
        for value, shown, identifier, named in _option_leaves(source):
            if isinstance(value, str):
                for m in _USERINFO.finditer(value):  # the password only: the user is an identifier
                    found.update(p for p in m.group(0)[len(m.group(1)):-1].split(":", 1)[1:]
                                 if len(p) >= MIN_SECRET_LEN)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)
            else:
                continue
            if not (shown or identifier) and len(value) >= (MIN_SECRET_LEN if named else MIN_UNNAMED_SECRET_LEN):
                found.add(value)
    return frozenset(found)


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
            return {(text(k) if isinstance(k, str) else k): _redact_item(k, v, walk) for k, v in o.items()}
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
