"""The wheel installs into a clean virtualenv and every folder imports as memstep.<folder>."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_wheel_installs_and_imports_in_clean_venv(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("memstep-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "memstep/core/engine.py" in names
    assert "memstep/executors/spec/drafts/smollm2-eagle.npz" in names, "the EAGLE head ships"
    assert not any(n.startswith(("memstep/tests", "tests/")) for n in names), "tests stay out"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    # third-party dependencies come from this environment's site-packages (a plain folder on
    # PYTHONPATH: its editable memstep hook is not activated), memstep only from the wheel
    deps = next(p for p in sys.path if p.endswith("site-packages"))
    modules = ", ".join(PACKAGES)
    code = f"import {modules}; print(memstep.__version__, memstep.__file__)"
    res = subprocess.run(
        [str(python), "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": f"{target}:{deps}"},
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    version, location = res.stdout.split()
    assert version == "0.1.0"
    assert location.startswith(str(target)), "imported from the wheel, not the checkout"


def test_every_top_level_folder_is_a_listed_package():
    """A new folder (as router/) left out of pyproject's list would be missing from the wheel."""
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert {f"memstep.{name}" for name in folders} <= set(PACKAGES)
