"""``scripts/setup.sh`` picks cpu or cuda at one boundary, and the stack check names a mismatch.

Real script, real shell: the GPU is faked only where setup.sh looks for it, an ``nvidia-smi``
first on PATH (what a GPU machine's driver installs), and every run stops before any change
(``DRY_RUN=1``) with ``HISTATE_VENV`` under tmp_path, so the real .venv is never touched.
The expected lines are written out by hand from setup.sh's plan per platform.

``scripts/verify_stack.py cuda`` runs against this machine's real CPU torch: the mismatch a
GPU user hits when a CPU torch came in (a CPU wheel on a find-links path, a reused .venv).

The ``cuda`` extra's resolution needs the network: ``make compat`` runs ``pip install
--dry-run`` of it against plain PyPI for every checked vLLM (``scripts/compat.py``);
``tests/test_compat.py`` checks its specifiers here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"
VERIFY = ROOT / "scripts" / "verify_stack.py"
H200 = "GPU 0: NVIDIA H200 (UUID: GPU-5a1f0c3e-0000-0000-0000-000000000000)"
CPU_PLAN = [
    "[setup] plan: pip install -e '.[dev,sim,live]'; uninstall torchvision/torchaudio/torchcodec;"
    " verify vLLM's CPU kernels",
    "[setup] DRY_RUN=1: stopping before any change",
]
CUDA_PLAN = [
    "[setup] plan: pip install -e '.[dev,sim,cuda]'; keep torchvision/torchaudio;"
    " verify torch.cuda.is_available()",
    "[setup] DRY_RUN=1: stopping before any change",
]


def fake_nvidia_smi(bin_dir: Path, stdout: str, rc: int) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] || exit 64\nprintf '%b' '{stdout}'\nexit {rc}\n")
    tool.chmod(0o755)


def run_setup(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "HISTATE_PLATFORM"}
    full.update({"DRY_RUN": "1", "HISTATE_VENV": str(tmp_path / "venv")})
    full["PATH"] = f"{tmp_path / 'bin'}:{full['PATH']}"
    full.update(env)
    return subprocess.run(["bash", str(SETUP)], env=full, capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_listed_gpu_picks_the_cuda_stack(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", H200 + "\\n", 0)
    done = run_setup(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"[setup] platform: cuda (nvidia-smi -L: 1 GPU(s), {H200})", *CUDA_PLAN]
    assert not (tmp_path / "venv").exists()


def test_a_failing_nvidia_smi_picks_the_cpu_stack(tmp_path: Path) -> None:
    # What nvidia-smi does on a machine with the driver tools but no usable GPU.
    fake_nvidia_smi(tmp_path / "bin", "NVIDIA-SMI has failed because it could not communicate "
                    "with the NVIDIA driver.\\n", 9)
    done = run_setup(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[setup] platform: cpu (no GPU listed by nvidia-smi -L)", *CPU_PLAN]
    assert not (tmp_path / "venv").exists()


def test_no_gpu_listed_picks_the_cpu_stack(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", "No devices found.\\n", 0)
    done = run_setup(tmp_path)
    assert done.stdout.splitlines()[0] == "[setup] platform: cpu (no GPU listed by nvidia-smi -L)"


def test_the_override_beats_detection(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", H200 + "\\n", 0)
    done = run_setup(tmp_path, HISTATE_PLATFORM="cpu")
    assert done.stdout.splitlines() == ["[setup] platform: cpu (HISTATE_PLATFORM=cpu)", *CPU_PLAN]


def test_an_unknown_platform_is_one_line_naming_the_key_and_values(tmp_path: Path) -> None:
    done = run_setup(tmp_path, HISTATE_PLATFORM="rocm")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "[setup] ERROR: HISTATE_PLATFORM=rocm; allowed values: cpu, cuda "
        "(unset: detect with nvidia-smi -L)"]


def run_verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(VERIFY), *args], capture_output=True, text=True,
                          timeout=120, check=False, cwd=ROOT)


def test_verify_rejects_a_bad_argument_in_one_line() -> None:
    done = run_verify("gpu")
    assert done.returncode == 3
    assert done.stderr.splitlines() == [
        "[setup] ERROR: usage: verify_stack.py cpu|cuda (got gpu)"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (live extra)")
def test_a_cpu_torch_on_the_cuda_platform_is_one_line() -> None:
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this environment holds a CUDA torch: the mismatch cannot be caused here")
    done = run_verify("cuda")
    assert done.returncode == 3
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"[setup] ERROR: platform cuda (a GPU is visible), but torch {torch.__version__} is a "
        "CPU build; set HISTATE_VENV to a fresh directory (or remove .venv) and run "
        "scripts/setup.sh"]


GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"


@pytest.mark.parametrize("override", ["", "cuda"])
def test_gpu_check_exits_at_once_on_a_cpu_machine(tmp_path: Path, override: str) -> None:
    # The override must not let a CPU machine through: gpu_check asks the detection itself.
    fake_nvidia_smi(tmp_path / "bin", "No devices found.\\n", 0)
    env = {k: v for k, v in os.environ.items() if k != "HISTATE_PLATFORM"}
    env.update({"PATH": f"{tmp_path / 'bin'}:{env['PATH']}", "HISTATE_PLATFORM": override,
                "GPU_CHECK_OUT": str(tmp_path / "out")})
    done = subprocess.run(["bash", str(GPU_CHECK)], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "gpu_check: needs a GPU (no GPU listed by nvidia-smi -L); on a CPU machine run make test"]
    assert not (tmp_path / "out").exists()
