"""A Dagster webserver's GraphQL API as the UI uses it (`DagsterClient`: launch, runs, events,
sensors, materializations), and a `dagster dev` (webserver + daemon + code server, via `python -m
assets`) on a given state dir driven through it (`DagsterDev`): what the integration tests, the
production profile's test and `docs/screenshots.py` talk to."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from factory.paths import REPO_ROOT

TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DagsterClient:
    """One client of a Dagster webserver's GraphQL API at `url` (…/graphql)."""

    def __init__(self, url: str):
        self.url = url
        self.location = self.repository = ""
        self.log: Path | str = url  # where to look when something times out
        # one connection pool for every request: a client per request builds a TLS context each time
        # (~40 ms of CPU), and a test polls runs several times a second
        self.http = httpx.Client(timeout=60)

    def wait_ready(self, timeout_s: float = 180, process: subprocess.Popen | None = None) -> None:
        """Until the code location is loaded and the daemons that launch and watch runs are healthy."""
        deadline = time.monotonic() + timeout_s
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"dagster exited ({process.returncode}); see {self.log}")
            try:
                repos = self.query("{ repositoriesOrError { ... on RepositoryConnection { nodes { name "
                                   "location { name } } } } }")["repositoriesOrError"].get("nodes", [])
                daemons = self.query("{ instance { daemonHealth { allDaemonStatuses { daemonType healthy } } } }")
                statuses = daemons["instance"]["daemonHealth"]["allDaemonStatuses"]
                if repos and all(d["healthy"] for d in statuses if d["daemonType"] in ("SENSOR", "QUEUED_RUN_COORDINATOR",
                                                                                        "MONITORING")):
                    self.location, self.repository = repos[0]["location"]["name"], repos[0]["name"]
                    return
            except (httpx.HTTPError, RuntimeError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"dagster at {self.url} was not ready in {timeout_s} s; see {self.log}")
            time.sleep(1)

    # ---- GraphQL -----------------------------------------------------------------------------

    def query(self, text: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        """One GraphQL request. A read that meets a server error or a refused connection (its storage
        restarting: seen as a 500 right after a Postgres restart) is retried with backoff for up to 60 s;
        a mutation is not (it may have been applied)."""
        from factory.recording.outage import Outage, retry

        def post() -> httpx.Response:
            response = self.http.post(self.url, json={"query": text, "variables": variables or {}})
            response.raise_for_status()
            return response

        def transient(error: BaseException) -> bool:
            if text.lstrip().startswith("mutation"):
                return False
            return isinstance(error, httpx.TransportError) or (
                isinstance(error, httpx.HTTPStatusError) and error.response.status_code >= 500)

        response = retry(post, Outage(lambda _: f"dagster at {self.url}", 60.0), transient)
        body = response.json()
        if body.get("errors"):
            raise RuntimeError(f"GraphQL errors: {body['errors']}")
        return body["data"]

    def selector(self, **extra) -> dict[str, str]:
        return {"repositoryLocationName": self.location, "repositoryName": self.repository, **extra}

    def launch(self, job: str, run_config: dict, tags: dict[str, str] | None = None) -> str:
        """launchRun; returns the new run's id."""
        data = self.query(
            """mutation Launch($params: ExecutionParams!) { launchRun(executionParams: $params) {
                 __typename ... on LaunchRunSuccess { run { runId } }
                 ... on PythonError { message } ... on RunConfigValidationInvalid { errors { message } } } }""",
            {"params": {"selector": self.selector(jobName=job), "runConfigData": run_config,
                        "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]}}})
        result = data["launchRun"]
        if result["__typename"] != "LaunchRunSuccess":
            raise RuntimeError(f"launchRun {job}: {result}")
        return result["run"]["runId"]

    def runs(self, **run_filter) -> list[dict[str, Any]]:
        """Runs matching a RunsFilter (e.g. tags=[{"key": …, "value": …}]), newest first."""
        data = self.query(
            """query Runs($filter: RunsFilter) { runsOrError(filter: $filter) { ... on Runs { results {
                 runId jobName status startTime endTime tags { key value } } } } }""", {"filter": run_filter})
        runs = data["runsOrError"]["results"]
        for run in runs:
            run["tags"] = {t["key"]: t["value"] for t in run["tags"]}
        return runs

    def run(self, run_id: str) -> dict[str, Any]:
        (found,) = self.runs(runIds=[run_id])
        return found

    def wait_for_runs(self, count: int, timeout_s: float, statuses=TERMINAL, **run_filter) -> list[dict[str, Any]]:
        """Poll until `count` runs matching the filter are in one of `statuses`."""
        deadline = time.monotonic() + timeout_s
        while True:
            runs = self.runs(**run_filter)
            done = [r for r in runs if r["status"] in statuses]
            if len(done) >= count:
                return done
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(done)}/{count} runs {run_filter} reached {statuses} in {timeout_s} s: "
                                   f"{[(r['jobName'], r['status']) for r in runs]}; see {self.log}")
            time.sleep(2)

    def wait_for_run(self, run_id: str, timeout_s: float) -> dict[str, Any]:
        return self.wait_for_runs(1, timeout_s, runIds=[run_id])[0]

    def events(self, run_id: str) -> list[dict[str, Any]]:
        """The run's event log: type, message, metadata (label → text/int/float/path value), check results."""
        data = self.query(
            """query Logs($runId: ID!) { logsForRun(runId: $runId) { ... on EventConnection { events {
                 __typename ... on MessageEvent { message }
                 ... on DisplayableEvent { metadataEntries { label
                   ... on TextMetadataEntry { text } ... on IntMetadataEntry { intValue }
                   ... on FloatMetadataEntry { floatValue } ... on PathMetadataEntry { path } } }
                 ... on AssetCheckEvaluationEvent { evaluation { checkName success } }
                 ... on MaterializationEvent { assetKey { path } partition } } } } }""", {"runId": run_id})
        events = data["logsForRun"]["events"]
        for event in events:
            event["metadata"] = {m["label"]: next((v for k, v in m.items() if k != "label"), None)
                                 for m in event.get("metadataEntries") or []}
        return events

    def sensors(self) -> dict[str, dict[str, Any]]:
        data = self.query(
            """query Sensors($repo: RepositorySelector!) { sensorsOrError(repositorySelector: $repo) {
                 ... on Sensors { results { name sensorState { id status } } } } }""", {"repo": self.selector()})
        return {s["name"]: s["sensorState"] for s in data["sensorsOrError"]["results"]}

    def stop_sensor(self, name: str) -> None:
        state = self.sensors()[name]
        data = self.query("""mutation Stop($id: String!) { stopSensor(id: $id) { __typename
                               ... on StopSensorMutationResult { instigationState { status } } } }""",
                          {"id": state["id"]})
        assert data["stopSensor"]["instigationState"]["status"] == "STOPPED", data

    def partition_keys(self, asset: str) -> list[str]:
        data = self.query("""query Keys($key: AssetKeyInput!) { assetNodeOrError(assetKey: $key) {
                               ... on AssetNode { partitionKeys } } }""", {"key": {"path": [asset]}})
        return data["assetNodeOrError"]["partitionKeys"]

    def materializations(self, asset: str, partition: str) -> list[dict[str, Any]]:
        """The asset's materializations of one partition (run id, metadata), newest first."""
        data = self.query(
            """query Mats($key: AssetKeyInput!, $partitions: [String!]) { assetOrError(assetKey: $key) {
                 ... on Asset { assetMaterializations(partitions: $partitions) { runId partition
                   metadataEntries { label ... on TextMetadataEntry { text } ... on IntMetadataEntry { intValue }
                   ... on FloatMetadataEntry { floatValue } ... on PathMetadataEntry { path } } } } } }""",
            {"key": {"path": [asset]}, "partitions": [partition]})
        found = data["assetOrError"]["assetMaterializations"]
        for m in found:
            m["metadata"] = {e["label"]: next((v for k, v in e.items() if k != "label"), None)
                             for e in m.pop("metadataEntries")}
        return found


class DagsterDev(DagsterClient):
    """`python -m assets -p PORT` with FACTORY_HOME=`home` and DAGSTER_HOME=`home`/dagster.

    The instance is the repo's dagster.yaml with a short run-monitoring poll interval (so a run
    whose worker is killed is marked failed within seconds, not the default's 30 s). Its runs start a
    local Ray each (the embedded profile), or attach to the cluster at `ray_address`.
    """

    def __init__(self, home: Path, monitoring_poll_s: int = 5, ray_address: str | None = None):
        self.home = home
        self.ray_address = ray_address  # runs attach to this Ray cluster; None: a local Ray per run
        self.dagster_home = home / "dagster"
        self.dagster_home.mkdir(parents=True, exist_ok=True)
        config = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
        config["run_monitoring"]["poll_interval_seconds"] = monitoring_poll_s
        (self.dagster_home / "dagster.yaml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}/graphql")
        self.log = home / "dagster-dev.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180) -> None:
        env = {**os.environ, "FACTORY_HOME": str(self.home), "DAGSTER_HOME": str(self.dagster_home),
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        for name in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "FACTORY_PROFILE", "FACTORY_ENV_FILE"):
            env.pop(name, None)
        if self.ray_address:
            env["RAY_ADDRESS"] = self.ray_address
        with open(self.log, "wb") as log:
            # its own session: teardown stops dagster dev and every process it started, and nothing else
            self.process = subprocess.Popen(
                [sys.executable, "-m", "assets", "-p", str(self.port)], cwd=REPO_ROOT, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_ready(timeout_s, self.process)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)  # == its pid: it leads the session it was started in
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait(timeout=30)
