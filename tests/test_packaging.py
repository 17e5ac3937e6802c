"""The wheel installs kvtier, kvtier.policies, kvtier.cli and the CUDA sources, and nothing else;
after a non-editable install, `import kvtier...` works from the clone's root too (where the source
tree's kvtier/ comes first on sys.path)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kvtier import key_index

REPO = Path(__file__).resolve().parents[1]


IMPORTS = ("import kvtier, kvtier.client, kvtier.store.page_store, kvtier.policies, "
           "kvtier.cli.main, kvtier.cuda; print(kvtier.__file__)")


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout without build outputs: setuptools reuses a checkout's build/ (and
    egg-info), and one left from before a module moved would put the old module in the wheel."""
    source = tmp_path_factory.mktemp("source") / "kvtier"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        "build", "dist", ".venv*", ".git", "__pycache__", "*.egg-info", ".*_cache", ".hypothesis"))
    return source


@pytest.fixture(scope="module")
def wheel_path(source_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = source_tree
    out_dir = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--quiet", "--wheel-dir", str(out_dir), str(source)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = out_dir.glob("kvtier-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel_names(wheel_path: Path) -> list[str]:
    with zipfile.ZipFile(wheel_path) as archive:
        return archive.namelist()


@pytest.fixture(scope="module")
def installed_dir(wheel_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed (not editable) into a directory of its own."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                    "--no-index", "--target", str(target), str(wheel_path)],
                   check=True, capture_output=True, text=True)
    return target


def run_imports(cwd: Path, site: Path) -> subprocess.CompletedProcess:
    # -c puts the working directory first on sys.path, ahead of the installed copy: from the
    # clone's root `kvtier` is the source tree's, as a user finds it after the quick start.
    # -S skips the .pth files, so this environment's own editable install (its import hook
    # maps kvtier.policies to policies/) cannot stand in; its site-packages still give numpy.
    path = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"],
                            sysconfig.get_paths()["platlib"]])
    return subprocess.run([sys.executable, "-S", "-c", IMPORTS], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": path})


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
    sources = {f"kvtier/cuda/{p.name}" for p in (REPO / "kvtier" / "cuda").glob("*.cu")}
    assert sources and shipped == sources


def test_no_top_level_directory_of_the_clone_shadows_a_common_distribution() -> None:
    """`python -m pytest` or `python -m kvtier` in the clone's root puts the root first on sys.path:
    a `cuda/` package there hid NVIDIA's `cuda` namespace, and CuPy 14 then failed to import on
    the first GPU machine that ran the tests."""
    shadowing = ("cuda", "nvidia", "torch", "numpy", "cupy", "lmdb", "msgspec", "vllm", "sglang")
    found = [name for name in shadowing if (REPO / name).is_dir() or (REPO / f"{name}.py").exists()]
    assert not found, f"the clone's root holds {found}: rename them or move them under kvtier/"


def test_wheel_declares_the_console_script(wheel_names: list[str], tmp_path: Path) -> None:
    assert any(name.endswith(".dist-info/entry_points.txt") for name in wheel_names)


def test_no_torch_or_cupy_among_dependencies() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [dep.split(">")[0].split("=")[0].split("[")[0].strip()
             for dep in project["dependencies"]]
    assert not {"torch", "cupy", "cupy-cuda12x"} & set(names)


def test_installed_wheel_imports_from_elsewhere(installed_dir: Path, tmp_path: Path) -> None:
    done = run_imports(tmp_path, installed_dir)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(installed_dir)
    assert not {"policies", "cli", "cuda"} & {p.name for p in installed_dir.iterdir()}


def test_installed_wheel_imports_from_the_clones_root(installed_dir: Path) -> None:
    done = run_imports(REPO, installed_dir)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(REPO / "kvtier")  # the source tree's


def test_the_source_trees_kvtier_links_its_top_level_packages() -> None:
    # kvtier/policies -> ../policies and so on: relative, so they hold in any clone.
    for name in ("policies", "cli"):
        link = REPO / "kvtier" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}"


def test_a_wheel_built_from_the_sdist_holds_the_same_files(wheel_names: list[str],
                                                           source_tree: Path,
                                                           tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir",
                    str(tmp_path / "sdist"), str(source_tree)],
                   check=True, capture_output=True, text=True)
    (sdist,) = (tmp_path / "sdist").glob("kvtier-*.tar.gz")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "--wheel-dir", str(tmp_path / "wheel"), str(sdist)],
                   check=True, capture_output=True, text=True)
    (wheel,) = (tmp_path / "wheel").glob("kvtier-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        from_sdist = archive.namelist()
    assert sorted(n for n in from_sdist if ".dist-info/" not in n) == sorted(
        n for n in wheel_names if ".dist-info/" not in n)


def test_the_native_index_reader_is_built() -> None:
    """The test install compiles kvtier/_index_native.c (setup.py; optional, for machines
    without a compiler): a build that failed unseen would leave every client's local lookup
    ten times slower, its tests run on the numpy path only."""
    assert key_index.native is not None
