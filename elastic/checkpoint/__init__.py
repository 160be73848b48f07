"""Checkpoints: layout, commit protocol and retention, DCP I/O, persister, uploader, staging, fencing."""
