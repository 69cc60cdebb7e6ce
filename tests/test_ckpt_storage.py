"""Storage against a real S3-protocol server (moto on loopback): uploads, retries, fail-fast errors, redaction."""

import os
import time

import pytest
from s3_server import s3, s3_bucket  # noqa: F401  (pytest fixtures)

from bigclip.ckpt import storage as storage_mod
from bigclip.ckpt.storage import Storage, StorageError, redact_options, redact_url


def test_multipart_upload_listing_and_download(s3, s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(storage_mod, "S3_PART_SIZE", 5 * 2**20)  # S3's minimum part: 11 MiB -> 3 parts
    src = tmp_path / "shard.bin"
    src.write_bytes(os.urandom(11 * 2**20 + 7))
    store = Storage(f"s3://{s3_bucket}/run/checkpoints")
    store.put_file(str(src), "step_1/shard.bin")
    store.put_bytes("step_1/manifest.json", b"{}")
    assert store.list_files() == {"step_1/shard.bin": 11 * 2**20 + 7, "step_1/manifest.json": 2}
    head = s3.client().head_object(Bucket=s3_bucket, Key="run/checkpoints/step_1/shard.bin")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart object
    store.get_file("step_1/shard.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    assert store.read_many(["step_1/manifest.json", "step_2/manifest.json"]) == {
        "step_1/manifest.json": b"{}",
        "step_2/manifest.json": None,
    }


def test_missing_bucket_fails_fast_with_one_line(s3):
    start = time.monotonic()
    with pytest.raises(StorageError) as err:
        Storage("s3://no-such-bucket-here/runs").check_writable()
    message = str(err.value)
    assert "no-such-bucket-here" in message and "exists" in message and "\n" not in message
    assert time.monotonic() - start < 20


def test_bad_credentials_fail_fast_without_leaking_them(s3, s3_bucket):
    with s3.enforce_auth():
        with pytest.raises(StorageError) as err:
            Storage(f"s3://{s3_bucket}/runs", {"key": "AKIAWRONGKEY", "secret": "wrong-secret-value"}).check_writable()
    message = str(err.value)
    assert "access denied" in message and "credentials" in message and "\n" not in message
    assert "wrong-secret-value" not in message


def test_secrets_are_redacted():
    options = {
        "key": "AKIA",
        "secret": "s3cr3t",
        "client_kwargs": {"endpoint_url": "http://u:p@host:9000", "aws_session_token": "tok"},
    }
    assert redact_options(options) == {
        "key": "***",
        "secret": "***",
        "client_kwargs": {"endpoint_url": "http://***@host:9000", "aws_session_token": "***"},
    }
    assert redact_url("s3://user:pass@bucket/x") == "s3://***@bucket/x"
    assert redact_url("/local/path") == "/local/path"
