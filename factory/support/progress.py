"""Live terminal progress of one run: the SFT warm start, then training (step, mean reward,
samples/s, staleness), as rich bars on stderr. Used by `factory run` and by the Dagster main job
(`python -m assets materialize`), which hand its methods to `factory.run.run` as callbacks."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RunProgress:
    """`with RunProgress(steps) as p: run(..., on_step=p.on_step, on_phase=p.on_phase, on_sft_step=p.on_sft_step)`."""

    def __init__(self, total_steps: int, console: Console | None = None, start: int = 0):
        """`start`: steps already done (a resumed run's checkpoint)."""
        self.console = console or Console(stderr=True)
        self.train = Progress(
            TextColumn("[bold]step {task.completed:>4.0f}/{task.total:.0f}"), BarColumn(),
            TextColumn("reward {task.fields[reward]:.3f}"),
            TextColumn("{task.fields[generated]:.0f} generated / {task.fields[rate]:.0f} trained samples/s"),
            TextColumn("staleness {task.fields[stale]:.2f} (max {task.fields[stale_max]:.0f})"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
        )
        self.bar = self.train.add_task("train", total=total_steps, completed=start, reward=0.0, rate=0.0, generated=0.0,
                                       stale=0.0, stale_max=0)
        self.sft = Progress(TextColumn("[bold]SFT warm start {task.completed:>4.0f}/{task.total:.0f}"), BarColumn(),
                            TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
                            console=self.console)
        self.sft_bar: TaskID | None = None

    def on_phase(self, text: str) -> None:
        self.console.print(f"[cyan]»[/cyan] {text}")

    def on_sft_step(self, done: int, total: int, loss: float) -> None:
        if self.sft_bar is None:
            self.sft.start()
            self.sft_bar = self.sft.add_task("sft", total=total, loss=loss)
        self.sft.update(self.sft_bar, completed=done, total=total, loss=loss)  # total shrinks on an early stop
        if done == total:
            self.sft.stop()

    def on_step(self, report) -> None:
        m = report.metrics
        if not self.train.live.is_started:
            self.train.start()
        self.train.update(self.bar, completed=report.step, reward=m.get("rollout/reward_mean", 0.0),
                          rate=m.get("perf/trained_samples_per_s", m.get("perf/samples_per_s", 0.0)),
                          generated=m.get("perf/generated_samples_per_s", 0.0), stale=m.get("staleness/mean", 0.0),
                          stale_max=m.get("staleness/max", 0))

    def close(self) -> None:
        self.sft.stop()
        self.train.stop()

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EvaluationProgress:
    """`factory evaluate`'s terminal progress: its stages, then a bar over episodes (rate, ETA) on stderr.
    `with EvaluationProgress() as p: evaluate_checkpoint(..., on_phase=p.on_phase, on_progress=p.on_progress)`."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.bar = Progress(TextColumn("[bold]evaluating {task.completed:>5.0f}/{task.total:.0f} episodes"), BarColumn(),
                            TextColumn("{task.fields[rate]:.1f} episodes/s"),
                            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)
        self.task: TaskID | None = None
        self.t0 = 0.0

    def on_phase(self, text: str) -> None:
        self.console.print(f"[cyan]»[/cyan] {text}")

    def on_progress(self, done: int, total: int) -> None:
        import time

        if self.task is None:
            self.bar.start()
            self.t0 = time.perf_counter()
            self.task = self.bar.add_task("eval", total=total, rate=0.0)
        self.bar.update(self.task, completed=done, rate=done / max(time.perf_counter() - self.t0, 1e-9))

    def __enter__(self) -> EvaluationProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()
