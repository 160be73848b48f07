"""Test and benchmark helpers (local S3 object storage via SeaweedFS)."""
