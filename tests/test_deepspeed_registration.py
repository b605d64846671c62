"""zerodp registered as the ``deepspeed`` module (zerodp.deepspeed.registration): opt-in only, what
transformers and accelerate see once installed, and the refusals (a real DeepSpeed installed or
imported, transformers/accelerate imported first). Each case runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from distributed import run_python


def _run(script: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    if pythonpath is None:
        return run_python(textwrap.dedent(script))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120, env=env
    )


def test_not_active_by_default() -> None:
    proc = _run("""
        import importlib.metadata, importlib.util
        import zerodp, zerodp.deepspeed
        assert importlib.util.find_spec("deepspeed") is None
        try:
            importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            print("absent")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "absent"


def test_install_registers_module_submodules_and_version() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    proc = _run("""
        import importlib, importlib.metadata, importlib.util, sys
        import zerodp.deepspeed.as_deepspeed
        import zerodp.deepspeed as zd
        from zerodp.deepspeed.registration import install, is_installed, uninstall, version
        assert install() is zd and is_installed()          # idempotent
        import deepspeed
        assert deepspeed is zd
        from deepspeed.runtime.zero import partition_parameters as pp
        assert pp is importlib.import_module("zerodp.deepspeed.runtime.zero.partition_parameters")
        assert pp.__spec__.name == "zerodp.deepspeed.runtime.zero.partition_parameters"  # its own spec kept
        assert deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES and deepspeed.comm.get_rank
        from deepspeed import DeepSpeedEngine, comm
        assert comm is zd.comm
        v = importlib.metadata.version("deepspeed")
        assert v == version() and v.startswith("0.19.8+zerodp."), v
        assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"
        from packaging.version import Version
        assert Version(v) >= Version("0.16.4")             # accelerate's highest minimum
        try:
            import deepspeed.no_such_module
        except ModuleNotFoundError as e:
            assert "deepspeed.no_such_module" in str(e) and "zerodp" in str(e), e
        else:
            raise AssertionError("deepspeed.no_such_module imported")
        from transformers.integrations.deepspeed import is_deepspeed_available
        from accelerate.utils import is_deepspeed_available as accelerate_sees
        assert is_deepspeed_available() and accelerate_sees()
        assert not any(d.metadata["Name"] == "deepspeed" for d in importlib.metadata.distributions())
        uninstall()
        assert not is_installed() and importlib.util.find_spec("deepspeed") is None
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("kind", ["package", "dist-info"])
def test_refuses_to_shadow_a_real_deepspeed(tmp_path: Path, kind: str) -> None:
    if kind == "package":
        (tmp_path / "deepspeed").mkdir()
        (tmp_path / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    else:  # installed metadata whose module is not importable
        info = tmp_path / "deepspeed-0.14.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.14.0\n")
    proc = _run(
        """
        import sys
        from zerodp.deepspeed.registration import DeepSpeedShadowError, install, is_installed
        try:
            install()
        except DeepSpeedShadowError as e:
            print(e)
        assert not is_installed() and getattr(sys.modules.get("deepspeed"), "__name__", "") != "zerodp.deepspeed"
    """,
        pythonpath=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "refuses to shadow" in proc.stdout and "Uninstall" in proc.stdout


def test_refuses_an_imported_deepspeed_module() -> None:
    proc = _run("""
        import sys, types
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
        from zerodp.deepspeed.registration import DeepSpeedShadowError, install
        try:
            install()
        except DeepSpeedShadowError as e:
            print(e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "already imported" in proc.stdout


def test_refuses_after_accelerate_decided() -> None:
    pytest.importorskip("accelerate")
    proc = _run("""
        import accelerate.accelerator
        from zerodp.deepspeed.registration import DeepSpeedShadowError, install, is_installed
        try:
            install()
        except DeepSpeedShadowError as e:
            print(e)
        assert not is_installed()
    """)
    assert proc.returncode == 0, proc.stderr
    assert "before importing" in proc.stdout and "accelerate.accelerator" in proc.stdout


def test_zerodp_run_command_line(tmp_path: Path) -> None:
    """``zerodp run --nproc N SCRIPT ARGS``: the script's own flags go to it untouched; the workers are
    ``python -m zerodp.app.run_script SCRIPT ARGS`` under torch's launcher."""
    from zerodp.app import cli

    script = tmp_path / "train.py"
    script.write_text("")
    args = cli.build_parser().parse_args(["run", "--nproc", "3", str(script), "--deepspeed", "ds.json", "--nproc", "9"])
    assert args.script == str(script) and args.script_args == ["--deepspeed", "ds.json", "--nproc", "9"]
    cmd = args.torchrun_prefix(args)
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "3", "--standalone"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--nproc", "2"])  # SCRIPT missing


def test_module_version_is_the_registered_version() -> None:
    """``deepspeed.__version__`` is what importlib.metadata reports once installed (a client's
    ``version.parse(deepspeed.__version__) >= version.parse("0.9")`` holds, as with DeepSpeed)."""
    from packaging.version import Version

    import zerodp.deepspeed as zd
    from zerodp.deepspeed.registration import version

    assert zd.__version__ == version()
    assert Version(zd.__version__) >= Version("0.16.4") and zd.__version__.startswith("0.19.8+zerodp.")
