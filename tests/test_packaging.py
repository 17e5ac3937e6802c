"""The wheel installs kvtier, kvtier.policies, kvtier.cli and the CUDA sources, and nothing else."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out_dir = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--quiet", "--wheel-dir", str(out_dir), str(REPO)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = out_dir.glob("kvtier-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_wheel_installs_everything_under_kvtier(wheel_names: list[str]) -> None:
    top_levels = {name.split("/")[0] for name in wheel_names}
    assert {t for t in top_levels if not t.endswith(".dist-info")} == {"kvtier"}


def test_policies_and_cli_install_inside_kvtier(wheel_names: list[str]) -> None:
    assert "kvtier/policies/__init__.py" in wheel_names
    assert "kvtier/policies/lru.py" in wheel_names
    assert "kvtier/cli/main.py" in wheel_names
    assert not any(name.startswith(("policies/", "cli/")) for name in wheel_names)


def test_every_package_of_the_source_tree_is_in_the_wheel(wheel_names: list[str]) -> None:
    roots = {"kvtier": REPO / "kvtier", "kvtier/policies": REPO / "policies",
             "kvtier/cli": REPO / "cli"}
    expected = {f"{prefix}/{init.relative_to(root)}"
                for prefix, root in roots.items() for init in root.rglob("__init__.py")
                if "__pycache__" not in init.parts}
    assert expected <= set(wheel_names), sorted(expected - set(wheel_names))


def test_cuda_kernels_ship_as_package_data(wheel_names: list[str]) -> None:
    shipped = {name for name in wheel_names if name.endswith(".cu")}
    sources = {f"kvtier/cuda/{p.name}" for p in (REPO / "cuda").glob("*.cu")}
    assert sources and shipped == sources


def test_wheel_declares_the_console_script(wheel_names: list[str], tmp_path: Path) -> None:
    assert any(name.endswith(".dist-info/entry_points.txt") for name in wheel_names)


def test_no_torch_or_cupy_among_dependencies() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [dep.split(">")[0].split("=")[0].split("[")[0].strip() for dep in project["dependencies"]]
    assert not {"torch", "cupy", "cupy-cuda12x"} & set(names)
