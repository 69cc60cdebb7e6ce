"""A real one-node Slurm cluster on this host for tests: munged, slurmctld and slurmd, all in a temp dir.

Not a conftest: a test module that needs Slurm imports the fixture,

    from slurm_cluster import slurm  # noqa: F401  (pytest fixture)

`slurm` (session): the running cluster. Its one node is this host's short name (`hostname -s`, reached at
127.0.0.1) in one partition `debug`, with at least 2 CPUs (SelectTypeParameters=CR_CPU: one task, one
CPU); no GPUs, no accounting (no slurmdbd), no cgroups (proctrack/linuxproc, task/none), JobRequeue=1,
KillWait=10 s. Finished jobs stay visible to `scontrol show job` for MinJobAge (300 s).
`slurm.env` holds what a client needs (SLURM_CONF); it is also set in this process while the fixture lives,
so `sbatch`/`scontrol` run by the code under test find the cluster. Jobs inherit the submitter's
environment (`sbatch --export=ALL`), so a job's `scontrol requeue $SLURM_JOB_ID` reaches this cluster too.

    job = slurm.submit(["--time=1", "job.sh"], cwd=str(tmp_path))  # `sbatch --parsable`; returns the id
    assert slurm.wait(job, timeout=30) == "COMPLETED"
    slurm.job_info(job)["Restarts"]  # `scontrol show job -o` as a dict: JobState, ExitCode, RunTime...

Times measured here (Slurm 22.05.8, this config):
- the cluster is up (node IDLE) ~1.1 s after start; a submitted job starts 0.5-2 s later.
- `--signal=B:USR1@N` and time limits are checked on slurmctld's 30 s tick, so the signal comes 0-30 s
  *before* limit-N (never after; with `--time=1 --signal=B:USR1@30` it came 7-27 s after start) and a job
  hits TIMEOUT up to 30 s after its limit. To signal at a chosen moment, `scancel --batch --signal=USR1 ID`.
- a job that requeues itself (`scontrol requeue $SLURM_JOB_ID`; JobRequeue=1, so no `--requeue` needed)
  keeps its id, sits PENDING (Reason=BeginTime) for cred_expire+1 s (cred_expire=5 here: ~6 s) and runs again
  with SLURM_RESTART_COUNT=1 (Slurm's default cred_expire=120 makes that ~3 min on a real cluster). The
  rerun truncates its --output file unless submitted with `--open-mode=append`.

The binaries (slurmctld, slurmd, munged, sbatch, ...) must be installed (Debian/Ubuntu: `slurm-wlm`,
`munge`): the fixture fails, it does not skip, when they are missing. The daemons run as the current user
(root or not: a non-root cluster runs that user's jobs) and die with this process if it is killed.
For a cluster with other settings, build one yourself: `SlurmCluster(tmp_dir, kill_wait=2, cpus=4)`.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

# States after which a job never runs again on its own (a requeued job goes back to PENDING instead).
FINAL_STATES = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
)
_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
_SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
# What a job or client inherits from us must not point at another cluster or job (pytest inside a Slurm job).
_FOREIGN_ENV = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SCONTROL_")
# `scontrol show job -o`: one line of Key=Value fields; keys may hold ':' or '/' (ReqB:S:C:T, CPUs/Task).
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w:/.]*)=")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(_SBIN))


def _user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"  ({e})"
    return "\n".join("  " + line for line in text[-lines:])


def parse_fields(line: str) -> dict[str, str]:
    """`Key=Value Key=Value ...` (scontrol's one-line output) as a dict; a value may contain spaces."""
    matches = list(_FIELD.finditer(line.strip()))
    out = {}
    for m, nxt in zip(matches, matches[1:] + [None]):
        out[m.group(1)] = line.strip()[m.end() : nxt.start() if nxt else None].strip()
    return out


class SlurmCluster:
    def __init__(
        self,
        root: Path,
        *,
        kill_wait: int = 10,
        cred_expire: int = 5,
        sched_interval: int = 1,
        cpus: int | None = None,
        real_memory_mb: int = 2048,
        extra_conf: str = "",
        start_timeout: float = 60.0,
    ) -> None:
        missing = [n for n in _DAEMONS + _CLIENTS if _which(n) is None]
        if missing:
            pytest.fail(
                f"Slurm test cluster: {', '.join(missing)} not found on PATH or in {', '.join(_SBIN)}; "
                "install Slurm and munge (Debian/Ubuntu: apt-get install slurm-wlm munge)",
                pytrace=False,
            )
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus or max(2, len(os.sched_getaffinity(0)))
        self.kill_wait = kill_wait
        self.cred_expire = cred_expire
        self.sched_interval = sched_interval
        self.real_memory_mb = real_memory_mb
        self.extra_conf = extra_conf
        self.start_timeout = start_timeout
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.log_dir = self.root / "log"
        self.env = {"SLURM_CONF": str(self.conf)}
        self._procs: dict[str, subprocess.Popen] = {}
        self.startup_s: float | None = None
        self.start()

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        t0 = time.monotonic()
        for d in ("etc", "munge", "state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._write_config()
        try:
            self._start_munged()
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
            self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.host])
            self._wait_node_idle()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this cluster started (SIGTERM, then SIGKILL)."""
        if self._procs.get("slurmctld") is not None and self._procs["slurmctld"].poll() is None:
            self._cancel_all_jobs()
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.pop(name, None)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            # the daemon's own helpers (slurmctld's slurmscriptd) share its process group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._kill_strays()

    def _write_config(self) -> None:
        r = self.root
        user = _user()
        (r / "etc" / "plugstack.conf").write_text("")  # no site SPANK plugins
        self.conf.write_text(
            f"""\
ClusterName=bigcliptest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={self.log_dir}/slurmctld.log
SlurmdLogFile={self.log_dir}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={r}/etc/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobRequeue=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval={self.sched_interval}
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait={self.kill_wait}
MinJobAge=300
ReturnToService=2
InactiveLimit=0
# the node as written here, whatever the host has (a 1-CPU runner still gets 2 CPUs)
SlurmdParameters=config_overrides
{self.extra_conf}
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.real_memory_mb} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _spawn(self, name: str, argv: list[str]) -> None:
        env = {**self._base_env(), **self.env, "BIGCLIP_SLURM_CLUSTER": str(self.root)}
        if _which("setpriv"):  # the daemon gets SIGTERM if this process dies without stop() (killed pytest)
            argv = [_which("setpriv"), "--pdeathsig=TERM", "--", *argv]
        with open(self.log_dir / f"{name}.out", "ab") as out:  # the child keeps its own copy
            self._procs[name] = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _start_munged(self) -> None:
        d = self.root / "munge"
        d.chmod(0o755)  # munged wants its socket's directory searchable by all
        key = d / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        # --force: pytest's temp dirs sit under a 0700 directory, which munged calls insecure/inaccessible
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={d / 'munged.pid'}",
                f"--log-file={self.log_dir / 'munged.log'}",
                f"--seed-file={d / 'munged.seed'}",
            ],
        )
        self._poll_until(lambda: self.munge_socket.exists(), 10, "munged's socket")

    def _wait_node_idle(self) -> None:
        def idle() -> bool:
            r = self._run(["scontrol", "show", "node", "-o", self.host], check=False)
            return r.returncode == 0 and parse_fields(r.stdout).get("State", "").startswith("IDLE")

        self._poll_until(idle, self.start_timeout, f"node {self.host} IDLE")

    def _poll_until(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            dead = {n: p.returncode for n, p in self._procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"Slurm test cluster: {dead} exited while waiting for {what}\n{self.logs()}")
            if ok():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm test cluster: no {what} after {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.1)

    def _cancel_all_jobs(self) -> None:
        self._run(["scancel", f"--user={_user()}"], check=False)
        deadline = time.monotonic() + self.kill_wait + 15
        while time.monotonic() < deadline:
            r = self._run(["squeue", "-h", "-t", "PENDING,RUNNING,SUSPENDED,COMPLETING", "-o", "%i"], check=False)
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(0.2)

    def _kill_strays(self) -> None:
        """SIGKILL leftovers of this cluster: slurmstepd (marked by our env) and job processes (our SLURM_CONF)."""
        mine = {f"BIGCLIP_SLURM_CLUSTER={self.root}".encode()}
        job = f"SLURM_CONF={self.conf}".encode()
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                env = set((pid_dir / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if env & mine or (job in env and any(v.startswith(b"SLURM_JOB_ID=") for v in env)):
                try:
                    os.kill(int(pid_dir.name), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- {p.name}\n{_tail(p, lines)}" for p in sorted(self.log_dir.glob("*")))

    # -- clients ---------------------------------------------------------------------------------------

    @staticmethod
    def _base_env() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_ENV)}

    def client_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment less any other cluster's/job's SLURM_* variables, plus `env`, plus ours."""
        return {**self._base_env(), **self.env, **(env or {})}

    def _run(self, argv: list[str], *, cwd=None, env=None, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(argv, cwd=cwd, env=self.client_env(env), capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr}{r.stdout}")
        return r

    def scontrol(self, *args: str) -> str:
        return self._run(["scontrol", *args]).stdout

    def submit(self, args: list[str], cwd: str, env: dict[str, str] | None = None) -> int:
        """`sbatch --parsable ARGS` in `cwd` with `env` added to the client environment; the job id."""
        r = self._run(["sbatch", "--parsable", *args], cwd=cwd, env=env, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed ({r.returncode}):\n{r.stderr}{r.stdout}")
        return int(r.stdout.strip().splitlines()[-1].split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        return parse_fields(self.scontrol("show", "job", "-o", str(job_id)))

    def state(self, job_id: int) -> str:
        return self.job_info(job_id)["JobState"]

    def cancel(self, job_id: int, *flags: str) -> None:
        self._run(["scancel", *flags, str(job_id)])

    def wait(self, job_id: int, states=FINAL_STATES, timeout: float = 60.0, poll: float = 0.2) -> str:
        """Poll until the job is in one of `states`; that state. TimeoutError (with the job's fields) if not."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            if info.get("JobState") in states:
                return info["JobState"]
            if time.monotonic() > deadline:
                fields = "\n".join(f"  {k}={v}" for k, v in info.items())
                raise TimeoutError(f"job {job_id} not in {tuple(states)} after {timeout:.0f} s:\n{fields}")
            time.sleep(poll)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF",)}
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        cluster.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
