"""A test-only stand-in for torchrun's process launch: one process that has imported torch and zerodp
once forks the ranks of each worker run (:class:`ForkLauncher`, used by
:func:`distributed.run_worker`).

Why: a torchrun launch on this 2-core machine spends about 5 s before a worker runs a line (the agent
imports torch, then each rank does), and ``make test`` launches workers over a hundred times. A forked
rank starts with the modules already imported.

What a rank sees is torchrun's contract for a script: a process of its own, ``sys.argv`` and ``__main__``
as for ``python script.py``, the caller's environment with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (rank 0 hosts the store through ``env://``, there is no agent store), its exit handlers
run at exit. As torchrun's agent does, the first rank that fails gets the others terminated (SIGTERM,
then SIGKILL after :data:`GRACE_S`). The ranks run the same zerodp code and gloo process groups as
under torchrun; only the launch differs. Tests of the launch itself (``zerodp train``, the examples, the
signal and swap-file tests, the CLI) run torchrun, and ``ZERODP_TEST_LAUNCHER=torchrun`` sends every
worker run through it too.

Protocol (this file run as a script): one JSON request per line on stdin, ``{"script", "argv", "nproc",
"env", "cwd", "timeout"}``; one JSON reply per line on stdout, ``{"returncode", "stdout", "stderr"}``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

#: seconds a rank gets to exit after SIGTERM once another rank failed (torchrun's agent: 30 s)
GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_env(base: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    env = dict(base)
    for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK"):
        env[key] = str(rank if key != "GROUP_RANK" else 0)
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"):
        env[key] = str(nproc)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ROLE_NAME="default")
    return env


def _child(req: dict, rank: int, port: int, out: Path) -> None:
    """In the forked rank: run the script as ``__main__``, then exit (never returns)."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: a stray grandchild is killed with it
        for fd, name in ((1, f"rank{rank}.out"), (2, f"rank{rank}.err")):
            f = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the launcher's request stream is not the rank's
        os.close(null)
        sys.stdin, sys.stdout = open(os.devnull), sys.__stdout__  # the launcher writes replies elsewhere
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(_rank_env(req["env"], rank, req["nproc"], port))
        os.chdir(req["cwd"])
        script = req["script"]
        sys.argv = [script, *req["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # what the interpreter runs at exit (swap-file removal, ...)
    except BaseException:  # the launch itself failed: said on the rank's stderr (or the launcher's)
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


def serve_one(req: dict) -> dict:
    """Fork ``req["nproc"]`` ranks of ``req["script"]``, wait for them (terminating the rest once one
    fails, all of them at the timeout); their output and the launch's return code (0 if every rank
    exited 0, else the first failure's code)."""
    port = _free_port()
    # not a TemporaryDirectory: its finalizer would be inherited and run by each rank's exit handlers
    out = Path(tempfile.mkdtemp(prefix="zerodp_fork_"))
    try:
        pids: dict[int, int] = {}  # pid -> rank
        for rank in range(req["nproc"]):
            pid = os.fork()
            if pid == 0:
                _child(req, rank, port, out)
            with contextlib.suppress(OSError):  # as the child does: no window where killpg misses it
                os.setpgid(pid, pid)
            pids[pid] = rank
        codes: dict[int, int] = {}
        first_failure: int | None = None
        deadline = time.monotonic() + req["timeout"]
        kill_at: float | None = None
        while len(codes) < len(pids):
            alive = [p for p, r in pids.items() if r not in codes]
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                now = time.monotonic()
                if now > deadline and kill_at is None:
                    _kill(alive, signal.SIGTERM)
                    first_failure, kill_at = first_failure or 124, now + GRACE_S
                if kill_at is not None and now > kill_at:
                    _kill(alive, signal.SIGKILL)
                time.sleep(0.005)
                continue
            if pid not in pids:
                continue
            code = os.waitstatus_to_exitcode(status)
            codes[pids[pid]] = code
            if code != 0 and first_failure is None:
                first_failure = code if code > 0 else 128 - code
                _kill([p for p in alive if p != pid], signal.SIGTERM)
                kill_at = time.monotonic() + GRACE_S

        def read(suffix: str) -> str:
            parts = [(out / f"rank{r}.{suffix}").read_text(errors="replace") for r in range(req["nproc"])]
            return "".join(parts)

        return {"returncode": first_failure or 0, "stdout": read("out"), "stderr": read("err")}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    """Import what the workers import, then serve requests until stdin closes."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import zerodp  # noqa: F401

    reply = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the protocol's stream
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    reply.flush()
    for line in sys.stdin:
        try:
            result = serve_one(json.loads(line))
        except Exception:
            result = {"returncode": 1, "stdout": "", "stderr": f"fork launcher failed:\n{traceback.format_exc()}"}
        reply.write(json.dumps(result) + "\n")
        reply.flush()


class ForkLauncher:
    """The pytest side: one launcher process for the session, started on first use, restarted if it
    died, stopped at exit. :meth:`run` returns a :class:`subprocess.CompletedProcess` as
    ``subprocess.run(torchrun ...)`` would."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen[str]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if not ready.startswith('{"ready"'):
            raise RuntimeError(f"the fork launcher did not start: {ready!r}")
        atexit.register(self.stop)
        return proc

    def run(
        self, script: str, argv: list[str], nproc: int, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            assert self.proc.stdin is not None and self.proc.stdout is not None
            req = {"script": script, "argv": argv, "nproc": nproc, "env": env, "cwd": os.getcwd(), "timeout": timeout}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork launcher exited while running a worker")
        r = json.loads(line)
        return subprocess.CompletedProcess([script, *argv], r["returncode"], r["stdout"], r["stderr"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


if __name__ == "__main__":
    main()
