"""Signs of life for long commands (`kvtier demo`, `kvtier replay`), wherever their output goes.

On a terminal: a rich spinner for a phase, a rich bar for counted steps. Elsewhere (a pipe, a CI
log, `> file`), where rich draws nothing until the end: one flushed line when a phase starts and
when it ends, and one at every tenth of the steps. Verbs: `phase`, `Steps.advance`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from rich.console import Console
from rich.progress import Progress


@contextmanager
def phase(console: Console, description: str, quiet: bool = False) -> Iterator[None]:
    """A spinner (terminal) or a start and an end line (elsewhere) around one step of work."""
    if quiet:
        yield
        return
    if console.is_terminal:
        with console.status(description):
            yield
        return
    started = time.perf_counter()
    console.print(f"{description} ...", highlight=False)
    console.file.flush()
    yield
    console.print(f"{description}: done in {time.perf_counter() - started:.1f} s",
                  highlight=False)
    console.file.flush()


class Steps:
    """Progress through `total` steps: a transient bar on a terminal, a line per tenth elsewhere.

    Use as a context manager and call `advance` after each step.
    """

    def __init__(self, console: Console, description: str, total: int,
                 quiet: bool = False) -> None:
        self._console = console
        self._description = description
        self._total = max(1, total)
        self._done = 0
        self._quiet = quiet
        self._bar: Progress | None = None
        self._started = time.perf_counter()

    def __enter__(self) -> Steps:
        if not self._quiet and self._console.is_terminal:
            self._bar = Progress(console=self._console, transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task(self._description, total=self._total)
        return self

    def advance(self) -> None:
        """One more step done."""
        self._done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
        elif not self._quiet and (self._done * 10 // self._total
                                  > (self._done - 1) * 10 // self._total):
            self._console.print(f"{self._description}: {self._done}/{self._total} "
                                f"({time.perf_counter() - self._started:.1f} s)", highlight=False)
            self._console.file.flush()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, traceback)
