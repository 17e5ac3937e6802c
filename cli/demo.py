"""`kvtier demo`: the daemon with its default configuration, serving a demo workload."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console, Group
from rich.live import Live
from rich.progress import Progress
from rich.table import Table

from kvtier.cli.params import BYTES
from kvtier.cli.progress import Steps, phase
from kvtier.cli.stats import render_stats
from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.client import Client
    from kvtier.integrations.model_demo import PromptFigures


def _has_transformers() -> bool:
    return all(importlib.util.find_spec(name) for name in ("torch", "transformers"))


def _ttft_table() -> Table:
    table = Table(title="time to first token: the same prompts without and with kvtier")
    for column in ("prompt", "tokens", "reused", "plain ms", "kvtier ms", "speed-up",
                   "same tokens"):
        table.add_column(column, justify="right")
    return table


def _ttft_cells(f: PromptFigures) -> list[str]:
    return [str(f.prompt_tokens), str(f.reused_tokens), f"{f.ttft_plain_ms:.0f}",
            f"{f.ttft_kvtier_ms:.0f}", f"{f.ttft_plain_ms / f.ttft_kvtier_ms:.1f}x",
            "yes" if f.same_tokens else "NO"]


@click.command()
@click.option("--workload", type=click.Choice(["auto", "model", "pages"]), default="auto",
              show_default=True,
              help="model: a small Llama answers prompts sharing a system prompt (needs the "
                   "transformers extra); pages: synthetic chat pages; auto: model if installed.")
@click.option("--requests", "num_requests", type=click.IntRange(1), default=None,
              help="Prompts (model) or requests (pages) [default: 6 / 48].")
@click.option("--host-capacity", type=BYTES, default=None,
              help="Host tier size [default: the daemon's, 10% of RAM up to 16GiB].")
@click.option("--disk-capacity", type=BYTES, default=None, help="Disk tier cap [default: 16GiB].")
@click.option("--disk-path", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Disk tier directory, kept afterwards [default: a temporary directory].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def demo(workload: str, num_requests: int | None, host_capacity: int | None,
         disk_capacity: int | None, disk_path: Path | None, as_json: bool) -> None:
    """Start `kvtier serve` with its default configuration, run a workload through it, stop it.

    The daemon gets a private socket and, unless --disk-path is given, a temporary disk
    directory, so the demo never touches a daemon or cache you already run. It prints what was
    reused (and, for the model, time to first token with and without kvtier and whether the
    generated tokens are identical), then the daemon's own stats.
    """
    from kvtier.testing.daemon_process import DaemonProcess

    if workload == "auto":
        workload = "model" if _has_transformers() else "pages"
    if workload == "model" and not _has_transformers():
        raise click.UsageError("the model workload needs torch and transformers: "
                               "pip install 'kvtier[transformers]'")
    console = Console(stderr=as_json)
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-demo-"))
    serve_args = ["--disk-path", str(disk_path or scratch / "disk")]
    serve_args += ["--host-capacity", str(host_capacity)] if host_capacity else []
    serve_args += ["--disk-capacity", str(disk_capacity)] if disk_capacity else []
    try:
        with phase(console, "starting kvtier serve (default configuration)", quiet=as_json):
            daemon = DaemonProcess.start(scratch / "kvtier.sock", *serve_args)
        try:
            with daemon.client("kvtier demo") as client:
                result = _run(workload, client, num_requests, console, as_json)
                stats, problems = client.stats(), client.check(verify_bytes=True)
        finally:
            exit_code = daemon.stop()
    except KvtierError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wrong = result.get("wrong_pages", 0) + sum(not f["same_tokens"]
                                               for f in result.get("prompts", []))
    if as_json:
        click.echo(json.dumps({"workload": workload, "demo": result, "stats": stats,
                               "check_problems": problems, "daemon_exit_code": exit_code}))
    else:
        console.print(render_stats(stats))
        console.print(f"integrity check: {'clean' if not problems else problems[:3]}; "
                      f"daemon stopped with exit code {exit_code}")
    if problems or wrong or exit_code != 0:
        sys.exit(1)


def _run(workload: str, client: Client, num_requests: int | None, console: Console,
         as_json: bool) -> dict:
    if workload == "model":
        return {"prompts": [asdict(f) for f in _run_model(client, num_requests or 6, console,
                                                          as_json)]}
    from kvtier.client.demo import run_page_workload

    total = num_requests or 48
    with Steps(console, "requests", total, quiet=as_json) as steps:
        report = run_page_workload(client, total, on_request=lambda _: steps.advance())
    if not as_json:
        console.print(f"{report.num_requests} requests, {report.pages_requested} pages asked, "
                      f"{report.pages_reused} reused "
                      f"({report.pages_reused / max(1, report.pages_requested):.1%}), "
                      f"{report.pages_verified} recalled pages verified byte for byte, "
                      f"{report.wrong_pages} wrong, in {report.elapsed_s:.2f} s")
    return asdict(report)


def _run_model(client: Client, total: int, console: Console,
               as_json: bool) -> list[PromptFigures]:
    """The model demo, its table growing a row per prompt as each is measured (a terminal), or
    a line per prompt and the table at the end (elsewhere)."""
    from kvtier.integrations.model_demo import run_model_demo

    table = _ttft_table()
    if as_json:
        return run_model_demo(client, num_prompts=total)
    if not console.is_terminal:
        def print_row(f: PromptFigures) -> None:
            table.add_row(str(table.row_count + 1), *_ttft_cells(f))
            console.print(f"prompt {table.row_count}/{total}: "
                          + ", ".join(f"{column.header} {cell}" for column, cell in
                                      zip(table.columns[1:], _ttft_cells(f))), highlight=False)
            console.file.flush()

        with phase(console, f"building the model, then {total} prompts"):
            figures = run_model_demo(client, num_prompts=total, on_prompt=print_row)
        console.print(table)
        return figures
    progress = Progress(console=console, transient=True)
    task = progress.add_task("prompts (the model is built first)", total=total)

    def add_row(f: PromptFigures) -> None:
        table.add_row(str(table.row_count + 1), *_ttft_cells(f))
        progress.advance(task)

    with Live(Group(table, progress), console=console, refresh_per_second=4):
        figures = run_model_demo(client, num_prompts=total, on_prompt=add_row)
    return figures
