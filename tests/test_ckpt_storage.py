"""Storage against a real S3-protocol server (moto on loopback): uploads, retries, fail-fast errors, redaction."""

import logging
import os
import shutil

import pytest
import torch
from s3_server import s3, s3_bucket  # noqa: F401  (pytest fixtures)

from bigclip.ckpt import storage as storage_mod
from bigclip.ckpt.manifest import FORMAT, MANIFEST, Manifest, unsafe_path
from bigclip.ckpt.participants import rank_file_bytes, read_rank_file
from bigclip.ckpt.rng import rng_state
from bigclip.ckpt.storage import Storage, StorageError, redact_options, redact_url
from bigclip.ckpt.verify import CorruptCheckpoint, fetch_verified
from bigclip.run.console import setup_console_logging
from bigclip.storage_options import redact_urls_in


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


def test_missing_bucket_fails_fast_with_one_line(s3, caplog):
    with pytest.raises(StorageError) as err:
        Storage("s3://no-such-bucket-here/runs").check_writable()
    message = str(err.value)
    assert "no-such-bucket-here" in message and "exists" in message and "\n" not in message
    assert "retrying" not in caplog.text  # failed at the first answer: nothing a retry could mend


def test_bad_credentials_fail_fast_without_leaking_them(s3, s3_bucket):
    with s3.enforce_auth():
        with pytest.raises(StorageError) as err:
            Storage(f"s3://{s3_bucket}/runs", {"key": "AKIAWRONGKEY", "secret": "wrong-secret-value"}).check_writable()
    message = str(err.value)
    assert "access denied" in message and "credentials" in message and "\n" not in message
    assert "wrong-secret-value" not in message


def test_secrets_are_redacted():
    """Every value of --storage-options is replaced, whatever its key is called; URLs lose their userinfo and
    their query string (presigned signatures, SAS tokens)."""
    options = {
        "key": "AKIA",
        "secret": "s3cr3t",
        "client_kwargs": {"endpoint_url": "http://u:p@host:9000", "headers": {"Authorization": "Bearer b"}},
        "connection_string": "AccountKey=k",
        "list": ["x", {"deep": "y"}],
    }
    r = "<redacted>"
    assert redact_options(options) == {
        "key": r,
        "secret": r,
        "client_kwargs": {"endpoint_url": r, "headers": {"Authorization": r}},
        "connection_string": r,
        "list": [r, {"deep": r}],
    }
    assert redact_options("not json") == r
    assert redact_url("s3://user:pass@bucket/x") == "s3://***@bucket/x"
    assert redact_url("https://h/x.tar?X-Amz-Signature=abc&sig=1") == "https://h/x.tar?<redacted>"
    assert redact_url("/local/path") == "/local/path"


def test_urls_inside_log_lines_and_errors_lose_credentials_and_signatures(tmp_path, capsys):
    """redact_urls_in on free text (several "::"-joined data URLs, a pipe: command, a shard named in a warning),
    and the log handlers: a data-loader warning quoting such a URL reaches neither out.log nor the console."""
    line = "--train-data http://u:PASS@h:1/x-{000..001}.tar?sig=SIG&a=b::s3://b/k?tok=TOK: not found"
    assert (
        redact_urls_in(line)
        == "--train-data http://***@h:1/x-{000..001}.tar?<redacted>::s3://b/k?<redacted>: not found"
    )
    assert redact_urls_in("pipe:curl -s https://h/x.tar?X-Amz-Signature=SIG | cat") == (
        "pipe:curl -s https://h/x.tar?<redacted> | cat"
    )
    assert redact_urls_in("0001 in s3://bucket/a.tar: bad image") == "0001 in s3://bucket/a.tar: bad image"

    out_log, root = str(tmp_path / "out.log"), logging.getLogger("bigclip")
    before = (list(root.handlers), root.propagate, root.level)
    setup_console_logging(out_log, active=True, debug=False)
    try:
        logging.getLogger("bigclip.data.skips").warning(
            "train data: skipped a sample (bad_image) 0001 in %s: cannot identify image file",
            "https://user:PLANTED-PASS@host/shard-000.tar?X-Amz-Signature=PLANTED-SIG",
        )
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:], root.propagate = before[0], before[1]
        root.setLevel(before[2])
    said = open(out_log).read() + capsys.readouterr().out
    assert said.count("https://***@host/shard-000.tar?<redacted>: cannot identify image file") == 2, said
    assert "PLANTED" not in said


def test_a_manifest_naming_paths_outside_the_checkpoint_is_refused(s3, s3_bucket, tmp_path):
    """A downloaded manifest is untrusted: '../' or absolute names would be written outside the download."""
    for bad in ("../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a\\b", "", "a/\0"):
        assert unsafe_path(bad), bad
    assert not unsafe_path("rng/rank_00000.pt") and not unsafe_path("__0_0.distcp")
    url = f"s3://{s3_bucket}/ckpt/step_1"
    manifest = Manifest("step_1", 1, 0, "ddp", "dcp", 1, {"../../escaped.txt": {"size": 3, "crc32": "0"}})
    s3.fs().pipe(f"{url}/{MANIFEST}", manifest.to_bytes())
    s3.fs().pipe(f"{url}/../../escaped.txt", b"bad")
    download = tmp_path / "a" / "b" / "download"
    with pytest.raises(CorruptCheckpoint, match=r"names '../../escaped.txt', a path outside the checkpoint"):
        fetch_verified(url, str(download))
    assert not any(p.name == "escaped.txt" for p in tmp_path.rglob("*"))


class _Payload:
    """Stands for any object whose unpickling would run code."""


def test_a_rank_file_with_arbitrary_objects_is_not_unpickled(tmp_path):
    good = tmp_path / "rank_00000.pt"
    good.write_bytes(rank_file_bytes({"rng": rng_state(), "data": {"epoch": 1, "ranks": [[1, 2]]}}))
    assert read_rank_file(str(good), FORMAT)["data"] == {"epoch": 1, "ranks": [[1, 2]]}  # weights_only=True loads it
    bad = tmp_path / "rank_00001.pt"
    torch.save({"rng": {"torch": torch.get_rng_state()}, "data": {"x": _Payload()}}, bad)
    with pytest.raises(CorruptCheckpoint, match="holds objects other than tensors and plain values"):
        read_rank_file(str(bad), FORMAT)


class _RunsCode:
    """Unpickling this would run a shell command (what a crafted .metadata could do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_dcp_metadata_and_values_are_read_without_running_code(tmp_path):
    """DCP's reader would pickle.load .metadata and torch.load(weights_only=False) non-tensor values; bigclip's
    reads the plain ones and refuses a file that would run code."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from bigclip.ckpt.dcp_layout import DCPLayout
    from bigclip.ckpt.dcp_safe_read import SafeFileSystemReader, SafeLoadPlanner, first_failure
    from bigclip.errors import UserError

    genuine = tmp_path / "genuine"
    state = {"model.w": torch.arange(6.0).reshape(2, 3), "extra": {"step": 3, "name": "adamw"}}
    dcp.save(state, checkpoint_id=str(genuine), no_dist=True)
    assert torch.equal(DCPLayout.read_model_state(str(genuine))["w"], state["model.w"])
    back = {"model.w": torch.zeros(2, 3), "extra": {"step": 0, "name": ""}}
    dcp.load(back, storage_reader=SafeFileSystemReader(str(genuine)), planner=SafeLoadPlanner(), no_dist=True)
    assert back["extra"] == {"step": 3, "name": "adamw"} and torch.equal(back["model.w"], state["model.w"])

    marker = tmp_path / "code-ran"
    crafted = tmp_path / "crafted"
    shutil.copytree(genuine, crafted)
    (crafted / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with pytest.raises(UserError, match=r"\.metadata is not plain DCP metadata \(names posix\.system"):
        DCPLayout.read_model_state(str(crafted))
    payload = tmp_path / "payload"  # a non-tensor value whose bytes would run code
    dcp.save({"model.w": state["model.w"], "extra": {"step": _RunsCode(str(marker))}}, checkpoint_id=str(payload),
             no_dist=True)  # fmt: skip
    back = {"model.w": torch.zeros(2, 3), "extra": {"step": 0}}
    with pytest.raises(BaseException) as refused:  # DCP wraps it in its CheckpointException
        dcp.load(back, storage_reader=SafeFileSystemReader(str(payload)), planner=SafeLoadPlanner(), no_dist=True)
    assert str(first_failure(refused.value)) == (
        "extra.step holds objects other than tensors and plain values; not loaded"
    )
    assert not marker.exists()


def test_deepspeed_files_are_scanned_before_deepspeed_unpickles_them(tmp_path):
    """DeepSpeed's loaders use torch.load(weights_only=False): bigclip first scans every .pt file's pickle
    (without running it) and refuses one naming anything beyond weights_only's set and DeepSpeed's bookkeeping
    classes. (The engine tests resume real ZeRO checkpoints through the same scan.)"""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from bigclip.ckpt.deepspeed_layout import refuse_unsafe_files
    from bigclip.errors import UserError

    engine = tmp_path / "ckpt" / "engine_state"
    engine.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}, "loss_scaler": LossScaler(1.0)}, engine / "mp_rank_00_model_states.pt")
    refuse_unsafe_files(str(tmp_path / "ckpt"))
    marker = tmp_path / "code-ran"
    torch.save({"module": {"w": torch.ones(2)}, "x": _RunsCode(str(marker))}, engine / "zero_pp_rank_0_optim_states.pt")
    with pytest.raises(UserError, match=r"engine_state/zero_pp_rank_0_optim_states.pt names posix.system, which a"):
        refuse_unsafe_files(str(tmp_path / "ckpt"))
    assert not marker.exists()
