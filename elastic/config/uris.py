"""Storage URIs checked as settings: a scheme fsspec knows, with its package installed.

A typo in `checkpoint.storage_uri` (`s4://`, `fille://`) used to pass validation and fail only
when the Trainer opened the storage, as a traceback, while `elastic config show` printed it as
valid. This check runs when the job is validated, so every command that reads a job refuses it,
naming the field. It reads fsspec's table of protocols and looks for the implementing package
without importing it (s3fs alone takes a second to import), so reading a job stays cheap.
"""
from __future__ import annotations

import importlib.util

SUGGESTION = "file:///an/absolute/path, s3://bucket/prefix (s3fs), or another fsspec protocol"


def protocols(uri: str) -> list[str]:
    """The protocols a URI names: `s3://b/k` -> ["s3"]; fsspec's chains `simplecache::s3://b/k`
    -> ["simplecache", "s3"]; a bare path -> []."""
    parts = uri.split("::")
    out = []
    for i, part in enumerate(parts):
        if "://" in part:
            out.append(part.split("://", 1)[0])
        elif i < len(parts) - 1:  # a chain's link names only a protocol; the last may be a path
            out.append(part)
    return out


def check_storage_uri(uri: str) -> str:
    """`uri`, or ValueError saying which scheme is unknown or which package it needs."""
    from fsspec.registry import known_implementations, registry
    for proto in protocols(uri):
        if proto in registry:
            continue
        known = known_implementations.get(proto)
        if known is None:
            raise ValueError(f"unknown storage scheme '{proto}://': use {SUGGESTION} (python -c "
                             f"'import fsspec; print(fsspec.available_protocols())' lists them)")
        package = known["class"].split(".", 1)[0]
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"storage scheme '{proto}://' needs the {package} package, which is "
                             f"not installed: pip install {package}")
    return uri
