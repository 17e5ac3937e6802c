"""examples/engine_client.py, the engine guide's example, runs against a real daemon and does
what docs/engine-guide.md says, and the guide shows that very file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvtier.testing import daemon as harness

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "engine_client.py"


def test_the_engine_example_runs_against_a_daemon(daemon) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE), "--socket", str(daemon.socket_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "stored 6 pages of prompt 1"
    assert lines[1].startswith("prompt 2: 4 of 5 pages held")
    assert "byte-identical: True" in lines[2]
    assert lines[3] == "recall after a delete: 1 done, 1 missing, missing page untouched: True"
    assert lines[4].startswith("refused as expected: [bad_request]")
    assert lines[-1] == "done"
    with daemon.client("after-example") as client:
        harness.assert_sound(client)
        names = [c["name"] for c in client.stats()["clients"]]
    assert "engine-example" not in names  # its exit released its session


def test_the_guide_shows_the_example_it_runs() -> None:
    guide = (REPO / "docs" / "engine-guide.md").read_text()
    assert "examples/engine_client.py" in guide
    index = (REPO / "docs" / "README.md").read_text()
    for doc in sorted((REPO / "docs").glob("*.md")):
        if doc.name != "README.md":
            assert f"]({doc.name})" in index, f"docs/README.md does not list {doc.name}"
    assert "integrations-vllm.md" in index
    assert "docs/README.md" in (REPO / "README.md").read_text()
