"""A rich progress bar per engine, on stderr so that --json's stdout stays clean."""

from __future__ import annotations


class ProgressBars:
    """A rich progress bar (one task per engine) on stderr, so --json's stdout stays clean."""

    def __init__(self, console) -> None:
        self.console, self.bar = console, None

    def __enter__(self):
        if self.console is None:
            return lambda name, total: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("tokens"), TimeElapsedColumn(), console=self.console, transient=True)
        self.bar.start()

        def task(name: str, total: int):
            tid = self.bar.add_task(f"{name}: starting", total=total)

            def update(phase: str | None, done: int | None) -> None:
                if phase:
                    self.bar.update(tid, description=f"{name}: {phase}")
                if done is not None:
                    self.bar.update(tid, completed=done)
            return update
        return task

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()
