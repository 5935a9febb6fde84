"""The production profile's services on one machine, under one supervisor.

    python -m infra.stack up     [--env-file infra/.env] [--dir <state>/production]
    python -m infra.stack status
    python -m infra.stack down

`up` installs what is missing (infra/production/install.sh), writes the env file from
infra/production/env.example when it is missing (with a fresh random Postgres password), and
starts a detached supervisor that runs, in this order, and restarts any that dies:

    postgres          PostgreSQL 15: databases dagster, iceberg (the lake's catalog), mlflow
    s3                s3rver, an S3 API server keeping objects on disk: the lake's warehouse, MLflow artifacts
    mlflow            `mlflow server` on Postgres, proxying artifacts to S3 (clients log over HTTP)
    ray               a Ray head node (`ray start --head --block`): the compute runs use (RAY_ADDRESS)
    code_server       `dagster api grpc -m assets.definitions`: the code location
    dagster_webserver the UI and GraphQL API, on Postgres storage (infra/production/dagster.yaml)
    dagster_daemon    sensors, schedules, the run queue and run monitoring

Everything binds to 127.0.0.1 (or the addresses the env file gives). The supervisor writes
`<dir>/stack.json` (its pid; each service's pid, restarts and readiness) and `<dir>/logs/*.log`.
`down` stops the supervisor, which stops every service and everything they started (run workers,
Ray workers, vLLM servers) and checks that nothing is left. Then `FACTORY_PROFILE=production`
(with FACTORY_ENV_FILE if the env file is not infra/.env) points `factory run`, `python -m assets`
and the Dagster assets at these services.

s3rver stands in for a real object store (no MinIO, SeaweedFS or Garage installs from the registries
these machines reach; Debian's radosgw needs a whole Ceph cluster): it keeps objects as files, so the
lake survives a restart, but accepts only its built-in key pair. Point FACTORY_S3_ENDPOINT at a real
store in production.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from factory.support import profile  # noqa: E402
from factory.paths import state_dir  # noqa: E402

PRODUCTION = REPO / "infra" / "production"
BIN = Path(sys.executable).parent
S3RVER_DIR = BIN.parent / "s3rver"  # in the venv: infra/production/install.sh puts it there
DATABASES = ("dagster", "iceberg", "mlflow")
STOP_GRACE_S = 15.0


class StackError(RuntimeError):
    """A service could not be installed, started or stopped (one line saying which and where to look)."""


# ---- the env file ---------------------------------------------------------------------------------

def write_env_file(path: Path, overrides: dict[str, str] | None = None) -> Path:
    """infra/production/env.example with a fresh Postgres password and `overrides`, mode 0600."""
    values = {"FACTORY_PG_PASSWORD": secrets.token_urlsafe(18), **(overrides or {})}
    lines = []
    for line in profile.EXAMPLE_ENV_FILE.read_text().splitlines():
        key = line.split("=", 1)[0].strip()
        if "=" in line and not line.lstrip().startswith("#") and key in values:
            line = f"{key}={values.pop(key)}"
        lines.append(line)
    lines += [f"{k}={v}" for k, v in values.items()]  # overrides the example does not list
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("\n".join(lines) + "\n")
    return path


def free_port_settings(host: str = "127.0.0.1") -> dict[str, str]:
    """Env-file overrides that put every service on a free port of `host` (a test's or benchmark's
    stack beside a user's own)."""
    def free() -> int:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    return {"FACTORY_PG_PORT": str(free()), "FACTORY_S3_ENDPOINT": f"http://{host}:{free()}",
            "MLFLOW_TRACKING_URI": f"http://{host}:{free()}", "RAY_ADDRESS": f"{host}:{free()}",
            "FACTORY_DAGSTER_PORT": str(free()), "FACTORY_DAGSTER_GRPC_PORT": str(free())}


def settings(env_file: Path) -> dict[str, str]:
    """The env file's values, each overridden by the environment's (the profile's precedence)."""
    if not env_file.is_file():
        raise StackError(f"{env_file} does not exist: `python -m infra.stack up` writes one, or copy "
                         f"{profile.EXAMPLE_ENV_FILE}")
    values = profile.read_env_file(env_file)
    return {k: os.environ.get(k, v) for k, v in values.items()}


def host_port(value: str) -> tuple[str, int]:
    parsed = urlparse(value if "://" in value else f"tcp://{value}")
    return parsed.hostname or "127.0.0.1", int(parsed.port or 80)


def bucket_of(url: str) -> str:
    return urlparse(url).netloc


# ---- readiness checks -----------------------------------------------------------------------------

def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---- services -------------------------------------------------------------------------------------

@dataclass
class Service:
    name: str
    argv: list[str]
    ready: Callable[[], bool]
    after_ready: Callable[[], None] | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = REPO
    process: subprocess.Popen | None = None
    restarts: int = 0
    is_ready: bool = False
    # Its process group dies with it: what a killed service leaves behind in its group holds its port
    # or data dir (the uvicorn under `mlflow server`, a postmaster's backends, Ray's raylet) and is
    # killed before the restart. Not the code server's: its group holds run workers, which outlive it.
    group_dies_with_it: bool = False
    stop_grace_s: float = STOP_GRACE_S  # from SIGTERM to SIGKILL when it is stopped


def postgres_bin(tool: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    if not found:
        raise StackError(f"PostgreSQL's {tool} is not installed: run infra/production/install.sh")
    return found[-1]


def as_postgres_user() -> list[str]:
    """Postgres refuses to run as root: drop to the `postgres` account (setpriv execs, no extra process)."""
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"] if os.geteuid() == 0 else []


class Stack:
    def __init__(self, env_file: Path, directory: Path, only: list[str] | None = None):
        self.only = only  # a subset of the services (e.g. postgres and s3 for bench/lake.py); None: all
        self.env_file = env_file.resolve()
        self.dir = directory.resolve()
        self.logs = self.dir / "logs"
        self.state_file = self.dir / "stack.json"
        self.values = settings(self.env_file)
        self.dagster_home = self.dir / "dagster"
        # Ray's unix sockets must fit in 107 bytes: keep its temp dir short, whatever the state path
        self.ray_tmp = Path(f"/tmp/factory-ray-{host_port(self.values['RAY_ADDRESS'])[1]}")
        self.services: list[Service] = []
        self.stopping = False

    def env(self) -> dict[str, str]:
        env = {**os.environ, **self.values, "FACTORY_PROFILE": "production", "FACTORY_ENV_FILE": str(self.env_file),
               "DAGSTER_HOME": str(self.dagster_home), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        return env

    # -- the services, in start order --

    def build(self) -> list[Service]:
        v = self.values
        pg_host, pg_port = v["FACTORY_PG_HOST"], v["FACTORY_PG_PORT"]
        s3_host, s3_port = host_port(v["FACTORY_S3_ENDPOINT"])
        mlflow_host, mlflow_port = host_port(v["MLFLOW_TRACKING_URI"])
        ray_host, ray_port = host_port(v["RAY_ADDRESS"])
        dagster_port, grpc_port = v["FACTORY_DAGSTER_PORT"], v["FACTORY_DAGSTER_GRPC_PORT"]
        buckets = sorted({bucket_of(v["FACTORY_LAKE_WAREHOUSE"]), bucket_of(v["FACTORY_MLFLOW_ARTIFACTS"])})
        node = S3RVER_DIR / "node_modules" / "s3rver" / "bin" / "s3rver.js"
        mlflow_store = profile.postgres_url("mlflow", v)
        workspace = self.dagster_home / "workspace.yaml"
        return [
            Service("postgres", [*as_postgres_user(), postgres_bin("postgres"), "-D", str(self.dir / "postgres"),
                                 "-h", pg_host, "-p", pg_port, "-c", "unix_socket_directories="],
                    ready=lambda: port_open(pg_host, int(pg_port)) and self.create_databases(),
                    group_dies_with_it=True),
            Service("s3", ["node", str(node), "-d", str(self.dir / "s3"), "-a", s3_host, "-p", str(s3_port), "--silent",
                           *[arg for b in buckets for arg in ("--configure-bucket", b)]],
                    ready=lambda: port_open(s3_host, s3_port)),
            Service("mlflow", [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", mlflow_store,
                               "--artifacts-destination", v["FACTORY_MLFLOW_ARTIFACTS"], "--host", mlflow_host,
                               "--port", str(mlflow_port), "--workers", "1"],
                    env={"MLFLOW_S3_ENDPOINT_URL": v["FACTORY_S3_ENDPOINT"],
                         "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                    ready=lambda: http_ok(f"http://{mlflow_host}:{mlflow_port}/health"), group_dies_with_it=True),
            Service("ray", [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", ray_host,
                            "--port", str(ray_port), "--temp-dir", str(self.ray_tmp),
                            "--num-cpus", v.get("FACTORY_RAY_CPUS", "16"), "--include-dashboard", "false",
                            "--disable-usage-stats"],
                    # loopback only (ENVIRONMENT.md): Ray binds every interface unless told not to
                    env={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0" if ray_host.startswith("127.") else "1",
                         "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"},
                    # Ray's head processes ignore SIGTERM for long, and hold nothing a run needs back: short grace
                    ready=lambda: port_open(ray_host, ray_port), group_dies_with_it=True, stop_grace_s=2.0),
            Service("code_server", [sys.executable, "-m", "dagster", "api", "grpc", "-m", "assets.definitions",
                                    "-h", "127.0.0.1", "-p", grpc_port, "--location-name", "factory"],
                    ready=lambda: port_open("127.0.0.1", int(grpc_port))),
            Service("dagster_webserver", [str(BIN / "dagster-webserver"), "-w", str(workspace), "-h", "127.0.0.1",
                                          "-p", dagster_port],
                    ready=lambda: http_ok(f"http://127.0.0.1:{dagster_port}/server_info"),
                    after_ready=self.set_pool_limits),
            Service("dagster_daemon", [str(BIN / "dagster-daemon"), "run", "-w", str(workspace)],
                    ready=lambda: True),
        ]

    # -- one-time preparation --

    def prepare(self) -> None:
        for sub in ("logs", "s3", "dagster"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy(PRODUCTION / "dagster.yaml", self.dagster_home / "dagster.yaml")
        (self.dagster_home / "workspace.yaml").write_text(
            "load_from:\n  - grpc_server:\n      host: 127.0.0.1\n"
            f"      port: {self.values['FACTORY_DAGSTER_GRPC_PORT']}\n      location_name: factory\n")
        pgdata = self.dir / "postgres"
        if not (pgdata / "PG_VERSION").is_file():
            pgdata.mkdir(parents=True, exist_ok=True)
            pwfile = self.dir / ".pgpass-init"
            pwfile.write_text(self.values["FACTORY_PG_PASSWORD"] + "\n")
            if os.geteuid() == 0:
                shutil.chown(pgdata, "postgres", "postgres")
                shutil.chown(pwfile, "postgres", "postgres")
            pwfile.chmod(0o600)
            try:
                done = subprocess.run([*as_postgres_user(), postgres_bin("initdb"), "-D", str(pgdata), "-U",
                                       self.values["FACTORY_PG_USER"], "--auth=scram-sha-256", f"--pwfile={pwfile}"],
                                      capture_output=True, text=True)
            finally:
                pwfile.unlink(missing_ok=True)
            if done.returncode != 0:
                raise StackError(f"initdb {pgdata} failed ({done.stderr.strip().splitlines()[-1:]}); as root the "
                                 f"`postgres` account must be able to enter every parent directory of {pgdata}")

    def create_databases(self) -> bool:
        import psycopg2

        v = self.values
        try:
            con = psycopg2.connect(host=v["FACTORY_PG_HOST"], port=v["FACTORY_PG_PORT"], user=v["FACTORY_PG_USER"],
                                   password=v["FACTORY_PG_PASSWORD"], dbname="postgres", connect_timeout=2)
        except psycopg2.OperationalError:
            return False
        con.autocommit = True
        with con.cursor() as cur:
            cur.execute("SELECT datname FROM pg_database")
            have = {row[0] for row in cur.fetchall()}
            for name in DATABASES:
                if name not in have:
                    cur.execute(f'CREATE DATABASE "{name}"')
        con.close()
        return True

    def set_pool_limits(self) -> None:
        subprocess.run([sys.executable, "-m", "dagster", "instance", "concurrency", "set", "trainer", "2"],
                       env=self.env(), capture_output=True, check=True, cwd=REPO)

    # -- supervision --

    def start(self, service: Service) -> None:
        log = open(self.logs / f"{service.name}.log", "ab")
        service.process = subprocess.Popen(service.argv, cwd=service.cwd, env={**self.env(), **service.env},
                                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)  # its own group: stopped as one
        log.close()
        service.is_ready = False
        self.write_state()

    def wait_ready(self, service: Service, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not service.ready():
            if service.process.poll() is not None:
                raise StackError(f"{service.name} exited ({service.process.returncode}) while starting; "
                                 f"see {self.logs / (service.name + '.log')}")
            if time.monotonic() > deadline:
                raise StackError(f"{service.name} was not ready in {timeout_s:.0f} s; "
                                 f"see {self.logs / (service.name + '.log')}")
            time.sleep(0.5)
        if service.after_ready is not None:
            service.after_ready()
        service.is_ready = True
        self.write_state()

    def write_state(self, error: str = "") -> None:
        state = {"supervisor": os.getpid(), "env_file": str(self.env_file), "error": error,
                 "ready": bool(self.services) and all(s.is_ready for s in self.services) and not self.stopping,
                 "services": {s.name: {"pid": s.process.pid if s.process else None, "restarts": s.restarts,
                                       "ready": s.is_ready} for s in self.services}}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    def supervise(self) -> None:
        """Start every service in order, then restart any that exits, until SIGTERM/SIGINT."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        try:
            self.prepare()
            self.services = [s for s in self.build() if self.only is None or s.name in self.only]
            for service in self.services:
                if self.stopping:
                    break
                self.start(service)
                self.wait_ready(service)
            backoff: dict[str, float] = {}
            while not self.stopping:
                for service in self.services:
                    if self.stopping or service.process.poll() is None:
                        continue
                    code = service.process.returncode
                    service.restarts += 1
                    delay = min(30.0, backoff.get(service.name, 0.5) * 2)
                    backoff[service.name] = delay
                    print(f"supervisor: {service.name} exited ({code}); restart {service.restarts} in {delay:.0f} s",
                          flush=True)
                    kill_tree(service)  # what it left behind (a postmaster's backends, Ray's raylet)
                    time.sleep(delay)
                    self.start(service)
                    try:
                        self.wait_ready(service)
                    except StackError as error:
                        print(f"supervisor: {error}", flush=True)
                time.sleep(0.5)
        except StackError as error:
            self.write_state(error=str(error))
            print(f"supervisor: {error}", flush=True)
        finally:
            self.stopping = True
            for service in reversed(self.services):
                kill_tree(service)
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
            self.write_state(error=json.loads(self.state_file.read_text()).get("error", "")
                             if self.state_file.exists() else "")


def kill_tree(service: Service) -> None:
    """SIGTERM the service's process and every descendant (and, with `group_dies_with_it`, its process
    group: a SIGKILLed parent's children are no longer its descendants), SIGKILL what outlives the grace."""
    import psutil

    if service.process is None:
        return
    pid = service.process.pid
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    if service.group_dies_with_it:  # started in a session of its own, so its group id is its pid
        procs += [p for p in psutil.process_iter() if p not in procs and process_group(p.pid) == pid]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=service.stop_grace_s if sig == signal.SIGTERM else 5)
        procs = alive
        if not procs:
            break
    try:
        service.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


# ---- the commands ---------------------------------------------------------------------------------

def read_state(directory: Path) -> dict | None:
    path = directory / "stack.json"
    return json.loads(path.read_text()) if path.is_file() else None


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def up(env_file: Path, directory: Path, timeout_s: float = 300, only: list[str] | None = None) -> dict:
    state = read_state(directory)
    if state and alive(state["supervisor"]):
        raise StackError(f"a stack already runs from {directory} (supervisor pid {state['supervisor']}); "
                         f"`python -m infra.stack down` first")
    subprocess.run(["bash", str(PRODUCTION / "install.sh")], check=True, env={**os.environ, "S3RVER_DIR": str(S3RVER_DIR)})
    if not env_file.is_file():
        write_env_file(env_file)
        print(f"stack: wrote {env_file} (mode 600) with a new Postgres password")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "stack.json").unlink(missing_ok=True)
    with open(directory / "supervisor.log", "ab") as log:
        supervisor = subprocess.Popen([sys.executable, "-m", "infra.stack", "supervise", "--env-file", str(env_file),
                                       "--dir", str(directory), *(["--only", ",".join(only)] if only else [])],
                                      cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        state = read_state(directory)
        if state and state["error"]:
            raise StackError(f"{state['error']} (supervisor log: {directory / 'supervisor.log'})")
        if state and state["ready"]:
            return state
        if supervisor.poll() is not None:
            raise StackError(f"the supervisor exited ({supervisor.returncode}); see {directory / 'supervisor.log'}")
        if time.monotonic() > deadline:
            raise StackError(f"the stack was not ready in {timeout_s:.0f} s; see {directory / 'logs'}")
        time.sleep(1)


def down(directory: Path, timeout_s: float = 120) -> None:
    state = read_state(directory)
    if not state or not alive(state["supervisor"]):
        print(f"stack: nothing runs from {directory}")
        return
    os.kill(state["supervisor"], signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while alive(state["supervisor"]):
        if time.monotonic() > deadline:
            raise StackError(f"the supervisor (pid {state['supervisor']}) did not stop in {timeout_s:.0f} s")
        time.sleep(0.5)
    left = [name for name, s in (read_state(directory) or state)["services"].items() if alive(s["pid"])]
    if left:
        raise StackError(f"still running after down: {', '.join(left)}")


def status(directory: Path) -> int:
    state = read_state(directory)
    if not state:
        print(f"stack: nothing was started from {directory}")
        return 1
    running = alive(state["supervisor"])
    print(f"supervisor pid {state['supervisor']}: {'running' if running else 'stopped'}"
          f"{' (ready)' if state['ready'] else ''}{'  error: ' + state['error'] if state['error'] else ''}")
    for name, s in state["services"].items():
        print(f"  {name:18} pid {s['pid'] or '-':>7}  {'up' if alive(s['pid']) else 'down':4}  restarts {s['restarts']}")
    print(f"use it: export FACTORY_PROFILE=production FACTORY_ENV_FILE={state['env_file']}")
    return 0 if running and state["ready"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "supervise"])
    parser.add_argument("--env-file", type=Path, default=None, help="default: $FACTORY_ENV_FILE or infra/.env")
    parser.add_argument("--dir", type=Path, default=None, help="default: <state dir>/production")
    parser.add_argument("--only", default="", help="comma-separated services to run (default: all)")
    args = parser.parse_args(argv)
    env_file = (args.env_file or profile.env_file()).resolve()
    directory = (args.dir or state_dir() / "production").resolve()
    only = [s for s in args.only.split(",") if s] or None
    try:
        if args.command == "supervise":
            Stack(env_file, directory, only).supervise()
        elif args.command == "up":
            state = up(env_file, directory, only=only)
            print(f"stack: up ({', '.join(state['services'])}); Dagster UI http://127.0.0.1:"
                  f"{settings(env_file)['FACTORY_DAGSTER_PORT']}\n"
                  f"use it: export FACTORY_PROFILE=production FACTORY_ENV_FILE={env_file}")
        elif args.command == "down":
            down(directory)
            print("stack: down")
        else:
            return status(directory)
    except (StackError, profile.ProfileError, subprocess.CalledProcessError) as error:
        print(f"stack: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
