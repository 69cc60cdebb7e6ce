"""The user-facing entry points as subprocesses: help, one-line errors, a CSV run with a bad row."""

import math
import os
import signal
import time

import pytest
import webdataset as wds
from helpers import (
    REPO,
    TINY_SYNTHETIC,
    TRAIN_SCRIPT,
    launch,
    python_train,
    read_metrics,
    start_job,
)
from PIL import Image
from tcp_proxy import TcpProxy


@pytest.mark.slow
def test_python_m_bigclip_help_is_grouped():
    out = launch("-m bigclip", ["--help"], 900, cwd=REPO)
    assert out.returncode == 0
    for group in ("data:", "model:", "training:", "distributed:", "--accum-freq"):
        assert group in out.stdout


@pytest.mark.slow
def test_bad_flag_is_one_line_and_nonzero(tmp_path):
    out = python_train(["--batch-size", "-1", "--logs", str(tmp_path)])
    assert out.returncode == 2
    assert out.stderr.strip() == "bigclip: error: --batch-size -1: must be a positive integer"
    assert not os.listdir(tmp_path)  # stopped before any work


@pytest.mark.slow
def test_corrupt_shards_read_by_loader_workers_stop_the_run_in_one_line(tmp_path):
    """The error is raised in a DataLoader worker, which the loader re-raises with the worker's traceback as
    text ("Caught UserError in DataLoader worker process 0. Original Traceback ..."): the user gets the line."""
    for i in range(2):
        (tmp_path / f"shard-{i}.tar").write_bytes(os.urandom(5000))
    shards = str(tmp_path / "shard-{0..1}.tar")
    out = python_train(["--model", "test-tiny", "--train-data", shards, "--dataset-type", "webdataset",
                        "--dataset-resampled", "--workers", "2", "--train-num-samples", "20", "--batch-size", "2",
                        "--precision", "fp32", "--logs", str(tmp_path / "logs")])  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"bigclip: error: --train-data {shards}: this loader found no usable sample in its shards; check that the "
        "shards hold .jpg/.png/.jpeg/.webp images with .txt captions (--image-key, --text-key, --json-text-key)"
    )
    assert "Traceback" not in out.stderr and "Caught UserError" not in out.stderr


@pytest.mark.slow
def test_csv_run_skips_and_counts_a_missing_image(tmp_path):
    rows = ["filepath\ttitle"]
    for i in range(23):  # 23 good rows + 1 missing = 3 full batches: every row is read
        path = tmp_path / f"img{i}.png"
        Image.new("RGB", (20, 20), color=(10 * i, 255 - 10 * i, 40)).save(path)
        rows.append(f"{path}\ta picture number {i}")
    rows.append(f"{tmp_path / 'gone.png'}\ta picture that is not there")
    csv = tmp_path / "train.csv"
    csv.write_text("\n".join(rows) + "\n")
    out = python_train(
        [
            "--train-data",
            str(csv),
            "--model",
            "test-tiny",
            "--batch-size",
            "8",
            "--epochs",
            "1",
            "--precision",
            "fp32",
            "--workers",
            "0",
            "--warmup",
            "1",
            "--logs",
            str(tmp_path / "logs"),
            "--name",
            "csv",
        ]
    )
    assert out.returncode == 0, out.stderr[-2000:]
    records = read_metrics(str(tmp_path / "logs" / "csv"))
    assert any(r.get("data/skipped_missing_image") == 1 for r in records)
    last_step = [r for r in records if "loss" in r][-1]  # step records carry the counts summed over ranks
    assert last_step["data/skipped_missing_image"] == 1
    assert "bad sample(s) skipped" in out.stdout + out.stderr


@pytest.mark.slow
def test_report_to_tensorboard_and_wandb_offline(tmp_path):
    from helpers import TINY_SYNTHETIC

    out = python_train(
        [
            *TINY_SYNTHETIC,
            "--epochs",
            "1",
            "--report-to",
            "tensorboard,wandb",
            "--logs",
            str(tmp_path),
            "--name",
            "sinks",
            # a remote store for the options to apply to (a folder, so the fsspec local filesystem ignores them)
            "--remote-sync",
            str(tmp_path / "remote"),
            "--remote-sync-protocol",
            "fsspec",
            "--storage-options",
            '{"key": "PLANTED-ARGV-KEY", "client_kwargs": {"headers": {"Authorization": "Bearer PLANTED-BEARER"}}}',
        ],
        WANDB_MODE="offline",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    run_dir = tmp_path / "sinks"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run_dir / "wandb").glob("offline-run-*"))
    # wandb records the command line and the config; tensorboard, params.yaml and out.log the config: none of
    # them may hold a --storage-options value, nor may the remote copy
    for path in (p for d in (run_dir, tmp_path / "remote") for p in d.rglob("*") if p.is_file()):
        data = path.read_bytes()
        assert b"PLANTED-ARGV-KEY" not in data and b"PLANTED-BEARER" not in data, path


@pytest.mark.slow
def test_webdataset_run_whose_shards_hold_no_usable_sample_stops_with_one_line(tmp_path):
    """Undecodable images, a truncated tar and a file that is no tar at all, read by a loader worker: one warning
    per bad shard or sample, then one error line; no worker traceback."""
    with wds.TarWriter(str(tmp_path / "bad.tar")) as sink:
        for i in range(4):
            sink.write({"__key__": f"b{i}", "jpg": b"not a jpeg", "txt": "a caption"})
    data = (tmp_path / "bad.tar").read_bytes()
    (tmp_path / "truncated.tar").write_bytes(data[:1500] + b"\x00garbage" * 300)
    (tmp_path / "junk.tar").write_bytes(b"this is not a tar file" * 100)
    out = python_train(["--train-data", str(tmp_path / "{bad,truncated,junk}.tar"), "--train-num-samples", "8",
                        "--model", "test-tiny", "--batch-size", "2", "--workers", "1", "--precision", "fp32",
                        "--logs", str(tmp_path / "logs"), "--name", "bad"])  # fmt: skip
    said = out.stdout + out.stderr
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("bigclip: error: the training data yielded no batch")
    assert "Traceback" not in said and "junk.tar: ReadError" in said


@pytest.mark.parametrize(
    "case",
    ["yaml_null", "yaml_wrong_type", "csv_not_utf8", "logs_not_creatable", "ds_section_not_object", "url_secrets"],
)
def test_bad_inputs_stop_with_one_line_and_leave_earlier_runs_alone(tmp_path, capsys, case):
    """Each bad input: exit code 2, one line naming the file or flag, no traceback; an earlier run's files under
    the same --logs are untouched."""
    from bigclip import cli

    logs = tmp_path / "logs"
    earlier = logs / "earlier"
    earlier.mkdir(parents=True)
    (earlier / "out.log").write_text("an earlier run\n")
    flags = ["--model", "test-tiny", "--dataset-type", "synthetic", "--logs", str(logs), "--name", "new"]
    named = {"yaml_null": "model: None is not a string", "yaml_wrong_type": "lr: '0.1' is not a number",
             "csv_not_utf8": "not UTF-8 text", "logs_not_creatable": "cannot create the run folder",
             "ds_section_not_object": '"zero_optimization.offload_optimizer" must be a JSON object',
             "url_secrets": "--train-data http://***@127.0.0.1:9/shard-000.tar?<redacted>: "}[case]  # fmt: skip
    if case.startswith("yaml"):
        (tmp_path / "run.yaml").write_text("model: null\n" if case == "yaml_null" else "lr: '0.1'\n")
        flags += ["--config", str(tmp_path / "run.yaml")]
    elif case == "ds_section_not_object":
        ds = tmp_path / "ds.json"
        ds.write_text('{"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}')
        flags += ["--engine", "deepspeed", "--ds_config", str(ds)]
    elif case == "url_secrets":  # a data URL's password and presigned signature: in no line, in no file
        url = "http://user:PLANTED-PASS@127.0.0.1:9/shard-{000..001}.tar?X-Amz-Signature=PLANTED-SIG"
        flags += ["--dataset-type", "webdataset", "--train-data", url, "--train-num-samples", "16"]
    elif case == "csv_not_utf8":
        (tmp_path / "pairs.csv").write_bytes(b"filepath\ttitle\n\xff\xfe.jpg\ta caption\n")
        flags = ["--model", "test-tiny", "--train-data", str(tmp_path / "pairs.csv"), "--logs", str(logs)]
    else:
        (tmp_path / "file").write_text("a file, not a directory")
        flags[flags.index(str(logs))] = str(tmp_path / "file" / "logs")
    code = cli.main(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("bigclip: error: ") and named in err[0], err
    assert os.listdir(earlier) == ["out.log"] and (earlier / "out.log").read_text() == "an earlier run\n"
    written = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert "PLANTED" not in err[0] and not any(b"PLANTED" in open(path, "rb").read() for path in written)
    if case == "yaml_null":  # --debug: the same line, with the traceback above it for a bug report
        assert cli.main([*flags, "--debug"]) == 2
        debug = capsys.readouterr().err.strip().splitlines()
        assert debug[0] == "Traceback (most recent call last):" and debug[-1] == err[0]


@pytest.mark.slow
def test_sigterm_during_setup_stops_at_once_with_one_line(tmp_path):
    """A --resume from a store that does not answer retries for minutes; a preemption notice then ends the
    process within seconds (nothing was trained, nothing to save)."""
    resume = "s3://bucket/runs/r/checkpoints/step_1"
    # The resume alone would retry for --storage-timeout (10 minutes here) and then stop with its own line.
    args = ["--model", "test-tiny", "--dataset-type", "synthetic", "--logs", str(tmp_path), "--name", "r",
            "--resume", resume, "--storage-timeout", "600"]  # fmt: skip
    proc = start_job(TRAIN_SCRIPT, args, AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_ACCESS_KEY_ID="x",
                     AWS_SECRET_ACCESS_KEY="x")  # fmt: skip
    log = tmp_path / "r" / "out.log"
    deadline = time.monotonic() + 600  # a guard: the run is waited for, not timed
    while time.monotonic() < deadline and not (log.exists() and "retrying with backoff" in log.read_text()):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # into the resume's retries
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 143
    assert (
        err.strip().splitlines()[-1] == "bigclip: SIGTERM received before training started: nothing to save; stopping"
    )


@pytest.mark.slow
def test_an_unanswering_store_stops_every_rank_within_storage_timeout(tmp_path):
    """--resume from an endpoint that accepts connections and never answers (botocore alone would wait 60 s
    per try, 5 tries): both ranks stop well within --storage-timeout plus start-up, each with at most one line,
    the error naming the URL and the flag; `bigclip export` from it the same. Both ranks raise the error together,
    but the first to exit makes torchrun stop the other, which may be stopped before it said its line (then with
    the SIGTERM line, or none once its handlers are restored): CI stop 49 saw rank 0's line alone."""
    url = "s3://bucket/runs/r/checkpoints/step_1"
    with TcpProxy.hanging() as endpoint:
        env = dict(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x")
        train = launch(TRAIN_SCRIPT, [*TINY_SYNTHETIC, "--logs", str(tmp_path), "--name", "r", "--resume", url,
                                      "--storage-timeout", "4"], 900, nproc=2, **env)  # fmt: skip
        export = launch("-m bigclip", ["export", url, str(tmp_path / "w.pt"), "--storage-timeout", "4"], 900, **env)
    assert train.returncode != 0 and export.returncode == 2
    said = [line for line in train.stderr.splitlines() if line.startswith("bigclip: error: ")]
    stopped = [line for line in train.stderr.splitlines() if "SIGTERM received before training started" in line]
    assert said, train.stderr  # the rank that exited first said why
    ranks = [line.removeprefix("bigclip: ").removeprefix("error: ").split(" on ")[0] for line in said + stopped]
    assert set(ranks) <= {"rank 0", "rank 1"} and len(ranks) == len(set(ranks)), train.stderr  # one line at most
    for line in said + export.stderr.strip().splitlines():
        assert "s3://bucket/runs/r/checkpoints/step_1" in line and "--storage-timeout" in line, line
    assert export.stderr.count("\n") == 1
    assert "bigclip/" not in train.stderr.replace("bigclip: error", "")  # torchrun's own report, no bigclip frame
    # The lines name --storage-timeout: the bound stopped them (botocore alone retries 5 x 60 s, past the guards).


@pytest.mark.slow
def test_openclip_mains_logging_and_schedule_flags(tmp_path):
    """--log-metric-every-n-steps: a scalars record every N steps between the log lines; --skip-scheduler: --lr
    from the first step (no warmup); --train-loss-ema-samples: the log line's parenthesised loss is the
    exponential average of the step losses over about that many samples."""
    # without --warmup: beside --skip-scheduler it would do nothing, and is refused
    tiny = [a for i, a in enumerate(TINY_SYNTHETIC) if "--warmup" not in TINY_SYNTHETIC[max(0, i - 1) : i + 1]]
    out = python_train(
        [*tiny, "--epochs", "1", "--logs", str(tmp_path), "--name", "main-flags"]
        + ["--log-every-n-steps", "4", "--log-metric-every-n-steps", "1", "--skip-scheduler"]
        + ["--train-loss-ema-samples", "16"]
    )
    assert out.returncode == 0, out.stderr[-2000:]
    records = [r for r in read_metrics(str(tmp_path / "main-flags")) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["step"] for r in records if "samples_per_s" in r] == [4, 8]  # the log lines' full records
    assert all(r["lr"] == pytest.approx(1e-3) for r in records)  # the default warmup would start at 1e-7
    decay = math.exp(-8 / 16)  # 8 samples per step
    ema = records[0]["loss"]
    for r in records[1:4]:
        ema = decay * ema + (1 - decay) * r["loss"]
    logged = (tmp_path / "main-flags" / "out.log").read_text()
    line = next(x for x in logged.splitlines() if "Train Epoch: 0 [32/64" in x)
    assert float(line.rsplit("(", 1)[1].rstrip(")")) == pytest.approx(ema, rel=1e-4)
