"""Credentials never shown: the job's repr, validation errors, storage and Parquet errors, the event
log, the run's error, `elastic status` and the driver's warning (elastic/config/secrets.py)."""
from __future__ import annotations

import json
import logging
import traceback
import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from elastic.config import ConfigError, JobConfig, parse_job
from elastic.config.secrets import is_secret_key, redact, redact_uri, scrub, secret_values
from elastic.storage import Storage, StorageError

SECRET = "wJalrXUtnFEMI-K7MDENG-EXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"
NESTED = "nested-session-token-123"

pytestmark = pytest.mark.timeout(60)


def job_dict(storage_uri: str = "memory://secrets", **checkpoint) -> dict:
    return {"run": {"name": "sec", "num_steps": 10},
            "scaling": {"num_workers": 3},
            "checkpoint": {"storage_uri": storage_uri,
                           "storage_options": {"key": KEY_ID, "secret": SECRET, "endpoint_url": "http://minio:9000",
                                               "client_kwargs": {"aws_session_token": NESTED, "region_name": "eu"}},
                           **checkpoint},
            "train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 48}}


def assert_clean(text: str) -> None:
    for s in (SECRET, NESTED):
        assert s not in text, f"{s!r} shown in: {text[:400]}"


# ------------------------------------------------------------------ the pure tools
def test_secret_looking_keys_at_any_depth_are_masked_and_nothing_else():
    opts = {"key": "k1", "secret": "s1", "token": "t1", "password": "p1", "endpoint_url": "http://x:9000",
            "anon": False, "region_name": "eu", "listings_expiry_time": 10,
            "client_kwargs": {"aws_secret_access_key": "s2", "aws_access_key_id": "k2", "region_name": "eu"},
            "headers": {"Authorization": "Bearer t2", "Accept": "json"},
            "AccountKey": "k3", "sas_token": "t3", "connection_string": "c1", "config_kwargs": {"retries": 3},
            "credentials": {"client_email": "e", "private_key": "k4"}}
    out = redact(opts)
    assert out["endpoint_url"] == "http://x:9000" and out["anon"] is False and out["region_name"] == "eu"
    assert out["listings_expiry_time"] == 10 and out["config_kwargs"] == {"retries": 3}
    assert out["client_kwargs"] == {"aws_secret_access_key": "***", "aws_access_key_id": "***", "region_name": "eu"}
    assert out["headers"] == {"Authorization": "***", "Accept": "json"}
    assert all(out[k] == "***" for k in ("key", "secret", "token", "password", "AccountKey", "sas_token",
                                         "connection_string", "credentials"))
    assert opts["secret"] == "s1"  # a copy: the original is untouched
    assert redact({"token": None}) == {"token": None}
    assert not any(is_secret_key(k) for k in ("endpoint_url", "anon", "region_name", "use_ssl", "requester_pays",
                                              "default_block_size", "version_aware", "cache_type", "monkey"))


def test_uri_passwords_are_hidden_and_plain_uris_kept():
    assert redact_uri(f"ftp://{KEY_ID}:{SECRET}@host/a") == "ftp://***@host/a"
    assert redact_uri(f"see s3://{KEY_ID}:{SECRET}@bucket/x and s3://b/y") == "see s3://***@bucket/x and s3://b/y"
    for plain in ("s3://bucket/run", "abfs://container@account.dfs.core.windows.net/p", "file:///tmp/x",
                  "http://minio:9000/b", "user@example.com: step 3"):
        assert redact_uri(plain) == plain
    assert secret_values(f"sftp://me:{SECRET}@host/p") >= {SECRET}


def test_scrub_removes_known_values_from_any_text():
    values = secret_values({"secret": SECRET, "client_kwargs": {"aws_session_token": NESTED}, "key": "ab"})
    assert values == {SECRET, NESTED}  # "ab" is too short to search text for (it would mangle numbers)
    ev = {"kind": "group_error", "error": f"SignatureDoesNotMatch for {SECRET}", "lost": [1],
          "nested": [{"why": f"token {NESTED}"}], "step": 3}
    out = scrub(ev, values)
    assert out == {"kind": "group_error", "error": "SignatureDoesNotMatch for ***", "lost": [1],
                   "nested": [{"why": "token ***"}], "step": 3}
    assert scrub(None, values) is None


# ------------------------------------------------------------------ config
def test_the_jobs_repr_and_str_show_no_credential():
    job = JobConfig.model_validate(job_dict(storage_uri=f"s3://{KEY_ID}:{SECRET}@bucket/runs"))
    for text in (repr(job), str(job), repr(job.checkpoint), str(job.checkpoint), f"{job.checkpoint!r}"):
        assert_clean(text)
    assert "endpoint_url': 'http://minio:9000'" in repr(job.checkpoint)  # the rest is still there
    data = parse_job({**job_dict(), "train": {"model": "m:f", "loss": "m:f", "global_batch_size": 48, "data": {
        "format": "parquet", "uri": "s3://b/c/*.parquet", "storage_options": {"secret": SECRET}}}})
    assert_clean(repr(data.train))
    assert_clean(repr(data))
    # The workers still get the credentials they need to open storage.
    assert SECRET in job.model_dump_json()


def test_a_validation_error_quotes_no_credential():
    bad = job_dict()
    bad["train"]["global_batch_size"] = 47  # not divisible by 3: the whole job's check fails
    with pytest.raises(Exception) as e:
        JobConfig.model_validate(bad)
    assert "not divisible" in str(e.value)
    assert_clean(str(e.value))
    with pytest.raises(ConfigError) as e:
        parse_job({**job_dict(), "checkpoint": {"storage_options": f"secret={SECRET}", "every_steps": "x"}})
    assert "checkpoint.storage_options" in str(e.value) and "(got 'x')" in str(e.value)
    assert_clean(str(e.value))


def test_the_driver_names_inline_credentials_and_recommends_the_environment(caplog):
    from elastic.trainer import _warn_inline_credentials
    with caplog.at_level(logging.WARNING, logger="elastic.trainer"):
        _warn_inline_credentials(parse_job(job_dict()))
    (record,) = caplog.records
    text = record.getMessage()
    assert "checkpoint.storage_options.key" in text and "checkpoint.storage_options.secret" in text
    assert "checkpoint.storage_options.client_kwargs.aws_session_token" in text and "AWS_SECRET_ACCESS_KEY" in text
    assert_clean(text)
    caplog.clear()
    plain = job_dict()
    plain["checkpoint"]["storage_options"] = {"endpoint_url": "http://minio:9000"}
    _warn_inline_credentials(parse_job(plain))
    assert not caplog.records


# ------------------------------------------------------------------ storage and data errors
class LeakyFS(MemoryFileSystem):
    """A filesystem whose errors quote its credentials, as a client library's might."""
    protocol = "leaky"

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.options = options
        if options.get("fail_init"):
            raise ValueError(f"bad credentials {options}")

    def cat_file(self, path, *a, **kw):
        raise PermissionError(f"403 for key={self.options.get('key')} secret={self.options.get('secret')}")

    def _open(self, path, mode="rb", **kw):
        raise ConnectionError(f"upload refused, session {self.options['client_kwargs']['aws_session_token']}")

    def isdir(self, path):
        raise PermissionError(f"list denied: {self.options}")


@pytest.fixture
def leaky():
    fsspec.register_implementation("leaky", LeakyFS, clobber=True)
    return job_dict()["checkpoint"]["storage_options"]


def test_a_storage_error_from_a_failing_filesystem_quotes_no_credential(leaky):
    storage = Storage(f"leaky://b-{uuid.uuid4().hex[:6]}", dict(leaky, skip_instance_cache=True))
    for call in (lambda: storage.read_bytes(storage.uri + "/x"), lambda: storage.write_bytes(storage.uri + "/y", b"1")):
        with pytest.raises(StorageError) as e:
            call()
        assert storage.uri in str(e.value) and "***" in str(e.value)
        # Nor does the traceback, which prints the cause (a library error quoting the secret).
        assert_clean("".join(traceback.format_exception(e.value)))
    with pytest.raises(StorageError) as e:
        Storage("leaky://other", dict(leaky, fail_init=True, skip_instance_cache=True))
    assert "cannot open storage" in str(e.value)
    assert_clean("".join(traceback.format_exception(e.value)))
    assert_clean(repr(storage))


def test_a_cause_without_credentials_is_kept_for_the_traceback(leaky):
    storage = Storage("memory://plain-cause", {"secret": SECRET})
    with pytest.raises(StorageError) as e:
        storage.read_bytes("memory://plain-cause/missing")
    assert isinstance(e.value.__cause__, FileNotFoundError)


def test_a_uri_password_is_not_in_storage_errors():
    storage = Storage(f"memory://{KEY_ID}:{SECRET}@host/run")
    with pytest.raises(StorageError) as e:
        storage.read_bytes(storage.uri + "/missing")
    assert "memory://***@host/run/missing" in str(e.value)
    assert_clean("".join(traceback.format_exception(e.value)))
    # Callers still tell a missing file from a failing store (the fence's "no fence yet").
    assert isinstance(e.value.__cause__, FileNotFoundError)


def test_parquet_errors_quote_no_credential(leaky):
    pytest.importorskip("pyarrow")
    from elastic.data.parquet import ParquetDataset
    with pytest.raises(StorageError) as e:
        ParquetDataset(f"leaky://d-{uuid.uuid4().hex[:6]}/corpus", None, dict(leaky, skip_instance_cache=True))
    assert "listing" in str(e.value)
    assert_clean("".join(traceback.format_exception(e.value)))


# ------------------------------------------------------------------ events, the run's error, status
def test_the_event_log_scrubs_credentials_from_every_event(tmp_path):
    from elastic.observability.events import EventLog, read_events
    storage = Storage(f"file://{tmp_path}")
    log = EventLog(storage, storage.uri + "/run", secrets=secret_values(job_dict()["checkpoint"]["storage_options"]))
    log.emit("group_error", error=f"botocore: InvalidAccessKeyId {KEY_ID}, signature for {SECRET}", lost=[1])
    log.emit("checkpoint_failed", rank=0, step=3, error=f"s3://{KEY_ID}:{SECRET}@b/x: denied",
             options={"secret": "short", "client_kwargs": {"aws_session_token": NESTED}})
    log.flush()
    written = (tmp_path / "run" / "events.jsonl").read_text()
    assert_clean(written)
    assert_clean(json.dumps(log.events))
    assert "short" not in written  # under a secret-looking key: masked whatever its length
    assert [e["kind"] for e in read_events(storage, storage.uri + "/run")] == ["group_error", "checkpoint_failed"]
    # The key id is an identifier: shown where text quotes it (S3's own messages do), masked only
    # as a setting; the secret never.
    assert log.events[0]["error"] == f"botocore: InvalidAccessKeyId {KEY_ID}, signature for ***"
    assert log.events[1]["error"] == "s3://***@b/x: denied"


def test_a_key_id_that_is_also_a_bucket_name_leaves_uris_whole():
    """SeaweedFS in the tests uses access key "elastic" on bucket "elastic": scrubbing the key id
    from text turned every checkpoint URI in the events into s3://***/..., so an event's `uri` no
    longer named the checkpoint the run's result did."""
    opts = {"key": "elastic", "secret": "elastic-secret", "endpoint_url": "http://127.0.0.1:9000"}
    values = secret_values(opts, "s3://elastic/runs")
    assert values == {"elastic-secret"}
    uri = "s3://elastic/final-5b9bc3/t-1/checkpoints/step_000000030"
    assert scrub({"kind": "final_checkpoint_committed", "uri": uri}, values)["uri"] == uri
    assert scrub({"key": "elastic"}, values) == {"key": "***"}  # as a setting it is still masked


def test_a_failed_runs_events_and_error_show_no_credential(monkeypatch):
    """Storage down for the whole restore wait, its error quoting the secret (as a client library's
    message might): the run fails, and neither its events, its written log nor its error show it."""
    from elastic.controller import restoring
    from elastic.controller.controller import Controller
    from elastic.controller.states import Errored
    from elastic.observability.events import read_events
    from tests.support.fake_group import FakeClock, FakeGroup

    def down(*a, **kw):
        raise StorageError(f"list failed: SignatureDoesNotMatch, secret {SECRET} session {NESTED}")

    monkeypatch.setattr(restoring, "committed_checkpoints", down)
    clock = FakeClock()
    job = JobConfig.model_validate(job_dict(f"memory://sec-{uuid.uuid4().hex[:8]}", restore_wait_s=5))
    c = Controller(job.model_dump_json(), group=FakeGroup(clock), clock=clock, wall=clock)
    out = c.run()
    assert isinstance(c.state, Errored) and out["status"] == "error"
    assert "SignatureDoesNotMatch, secret ***" in out["error"]
    assert any(e["kind"] == "storage_unanswered" for e in out["events"])
    assert_clean(json.dumps(out, default=str))
    assert_clean(json.dumps(read_events(c.storage, c.run_dir)))


def test_status_shows_no_credential_from_an_old_log(tmp_path, capsys):
    from elastic.observability.status import run_status
    run = tmp_path / "run"
    run.mkdir()
    events = [{"t": 1.0, "kind": "run_started", "run": "r", "num_workers": 2, "num_steps": 10,
               "run_dir": f"s3://{KEY_ID}:{SECRET}@bucket/r"},
              {"t": 2.0, "kind": "run_failed", "step": 1, "error": f"read s3://{KEY_ID}:{SECRET}@bucket/r failed"}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for as_json in (False, True):
        assert run_status(str(run), as_json=as_json, now=3.0) == 0
        out = capsys.readouterr().out
        assert "s3://***@bucket/r" in out
        assert_clean(out)
    assert run_status(f"memory://{KEY_ID}:{SECRET}@nowhere/r") == 2
    err = capsys.readouterr().err
    assert "no events in memory://***@nowhere/r" in err
    assert_clean(err)


# ------------------------------------------------------------------ storage options by allow-list
BEARER = "bearer-under-a-plain-name-7f3a"


def test_a_secret_under_an_unforeseen_storage_option_is_masked_in_config_yaml_repr_and_errors(leaky):
    """Storage options are shown by allow-list: `headers: {x-api-bearer: ...}` has no secret-looking
    name, yet its value stays out of the run's config.yaml (written by the controller at its
    start), the job's repr and any error or event that quotes it; the settings on the list
    (endpoint_url, region_name, anon, client_kwargs.region_name, config_kwargs) are still shown."""
    import yaml

    from elastic.config.loading import dump_job
    from elastic.config.secrets import job_secrets
    from elastic.controller.controller import Controller
    from elastic.storage import join
    from tests.support.fake_group import FakeClock, FakeGroup

    options = {"endpoint_url": "http://minio:9000", "region_name": "eu", "anon": False,
               "headers": {"x-api-bearer": BEARER}, "client_kwargs": {"region_name": "eu"},
               "config_kwargs": {"read_timeout": 10}}
    raw = job_dict(f"memory://opts-{uuid.uuid4().hex[:8]}")
    raw["checkpoint"]["storage_options"] = options
    job = JobConfig.model_validate(raw)
    clock = FakeClock()
    c = Controller(job.model_dump_json(), group=FakeGroup(clock), clock=clock, wall=clock)
    assert c.run()["status"] == "finished"
    written = c.storage.read_bytes(join(c.run_dir, "config.yaml")).decode()
    assert BEARER not in written
    assert yaml.safe_load(written)["checkpoint"]["storage_options"] == {**options, "headers": {"x-api-bearer": "***"}}
    for text in (dump_job(job), repr(job), str(job), repr(job.checkpoint), str(job.checkpoint)):
        assert BEARER not in text and "x-api-bearer" in text and "http://minio:9000" in text
    # The values masked are the values scrubbed from events and errors.
    assert BEARER in job_secrets(job)
    with pytest.raises(StorageError) as e:  # LeakyFS's error quotes its options, headers included
        Storage(f"leaky://b-{uuid.uuid4().hex[:6]}", dict(options, fail_init=True, skip_instance_cache=True))
    text = "".join(traceback.format_exception(e.value))
    assert "x-api-bearer" in text and BEARER not in text
    # ...and a command-line override that sets it, quoted in a validation error.
    from elastic.config.loading import redact_override
    assert redact_override(f"--set checkpoint.storage_options.headers.x-api-bearer={BEARER}") == \
        "--set checkpoint.storage_options.headers.x-api-bearer=***"
    assert redact_override("--set checkpoint.storage_options.endpoint_url=http://x") == \
        "--set checkpoint.storage_options.endpoint_url=http://x"
