"""Run Celery's ``t/integration`` against a private Redis: plain, with celery-fair, with keys.

The tests come from the source distribution of the Celery version installed in
the target interpreter (``--python``), downloaded with ``pip download`` and
extracted to a temporary directory at run time; nothing of Celery's is copied
into this project.  Only ``t/`` and ``pyproject.toml`` (pytest settings) are
extracted, so the tests import the *installed* ``celery``, not the sdist's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.harness.redis import RedisServer

from .compare import compare, render_markdown

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RESULTS = REPO / "bench" / "results"
PLUGIN_DIR = HERE / "pytest_plugin"
PLUGIN = "celery_fair_it"

MODULES = ("test_tasks.py", "test_canvas.py", "test_inspect.py", "test_worker.py")
#: The runs, in order: plain Celery, celery_fair.install on every app, and the same
#: with every task of the suite's queue keyed by its name (fair_keys).
RUNS = ("plain", "fair", "keyed")

#: Tests deselected by default, with the reason.  Node ids that a Celery version
#: does not have are ignored by pytest.
_CHORD = "t/integration/test_canvas.py::test_chord::"
_SLOW = (
    "takes 2-5 minutes (7 chords, each with 10 s waits that must time out), "
    "so it always hits the per-test timeout"
)
DESELECT: dict[str, str] = {
    _CHORD + "test_enabling_flag_allow_error_cb_on_chord_header": _SLOW,
    _CHORD + "test_disabling_flag_allow_error_cb_on_chord_header": _SLOW,
    _CHORD + "test_flag_allow_error_cb_on_chord_header_on_upgraded_chord": _SLOW,
    _CHORD + "test_error_propagates_from_chord": (
        "xfail on a Redis backend (Celery issue #6437): it hangs until the per-test timeout"
    ),
}

#: Tests deselected with ``--worker subprocess`` only, with the reason: they read the
#: state of, or listen to, a worker running in the pytest process (the embedded
#: worker), which ``--worker embedded`` covers.
_TASKS = "t/integration/test_tasks.py::"
_STAMPING = "t/integration/test_canvas.py::test_stamping_mechanism::"
_SIGNALS = _TASKS + "test_signal_bound_method_receivers::"
_STATE = (
    "reads celery.worker.state in the pytest process, the embedded worker's state; "
    "a worker in another process leaves it empty"
)
_RECEIVED = (
    "connects a task_received receiver in the pytest process: the signal is sent by the "
    "worker, in the worker's process"
)
_CAPLOG = "reads the worker's log records through caplog: the worker logs in its own process"
DESELECT_SUBPROCESS: dict[str, str] = {
    _TASKS + "test_tasks::test_send_task_without_ignore_result_uses_task_ignore_result": _STATE,
    _TASKS + "test_tasks::test_send_task_without_ignore_result_stores_result": _STATE,
    _TASKS + "test_task_redis_result_backend::test_retry_preserves_ignore_result_false": _STATE,
    _TASKS + "test_task_redis_result_backend::test_retry_preserves_ignore_result_true": _STATE,
    _TASKS + "test_tasks::test_revoked_by_headers_simple_canvas": (
        "clears the embedded worker's revoked stamps (celery.worker.state) between its "
        "iterations; the worker in another process keeps them and revokes the next ones"
    ),
    "t/integration/test_inspect.py::test_Inspect::test_hello_stamps_received_revoked_ids_locally": (
        _STATE
    ),
    "t/integration/test_inspect.py::test_Inspect::test_stats": (
        "asserts that the worker's pid is the pytest process's, and concurrency 1"
    ),
    _TASKS + "test_task_replacement::test_replaced_task_nesting_level_0": _RECEIVED,
    _TASKS + "test_task_replacement::test_replaced_task_nesting_level_1": _RECEIVED,
    _TASKS + "test_task_replacement::test_replaced_task_nesting_chain": _RECEIVED,
    _SIGNALS + "test_each_instance_receives": _RECEIVED,
    _SIGNALS + "test_disconnect_leaves_other_instance_connected": _RECEIVED,
    _SIGNALS + "test_other_instance_receives_after_garbage_collection": _RECEIVED,
    _STAMPING + "test_task_received_has_access_to_stamps": _RECEIVED,
    _STAMPING + "test_linking_stamped_sig": _RECEIVED,
    _STAMPING + "test_err_linking_stamped_sig": _RECEIVED,
    _TASKS + "test_trace_log_arguments::test_task_success": _CAPLOG,
    _TASKS + "test_trace_log_arguments::test_task_failed": _CAPLOG,
}

_PROBE = r"""
import importlib.metadata as md, importlib.util, json, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable, "dists": {}}
for name in ("celery", "kombu", "redis", "billiard", "pytest", "pytest-timeout",
             "pytest-rerunfailures", "pytest-subtests", "pytest-celery", "pydantic",
             "django", "celery-fair"):
    try:
        out["dists"][name] = md.version(name)
    except md.PackageNotFoundError:
        out["dists"][name] = None
eps = md.entry_points()
eps = eps.select(group="pytest11") if hasattr(eps, "select") else eps.get("pytest11", [])
out["pytest11"] = sorted(f"{ep.name}={ep.value}" for ep in eps)
out["pip"] = importlib.util.find_spec("pip") is not None
spec = importlib.util.find_spec("celery_fair")
out["celery_fair_path"] = str(spec.origin) if spec else None
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Absolute but not resolved: a venv's bin/python is often a symlink.
    python = shutil.which(str(Path(args.python).expanduser())) or args.python
    python = os.path.abspath(python)
    env_info = probe(python)
    celery_version = env_info["dists"]["celery"]
    if not celery_version:
        print(f"{python}: celery is not installed", file=sys.stderr)
        return 2
    if env_info["celery_fair_path"] is None and set(args.runs) - {"plain"}:
        print(f"{python}: celery_fair is not importable (pip install -e {REPO})", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix=f"celery-it-{celery_version}-"))
    keep = args.keep
    try:
        sdist = args.sdist or download_sdist(celery_version, work)
        tree = extract_tests(Path(sdist), work / "src")
        if tree is None:
            print(f"{sdist} has no t/integration: cannot run Celery's tests", file=sys.stderr)
            return 2
        # A module, or one test of it: test_tasks.py::test_tasks::test_revoked.
        modules = [
            m for m in args.modules if (tree / "t" / "integration" / m.split("::", 1)[0]).exists()
        ]
        missing_modules = [m for m in args.modules if m not in modules]
        missing = missing_deps(env_info, tree, reruns=args.reruns)
        if missing:
            if not args.install_deps:
                print(
                    f"{python} lacks the test dependencies {' '.join(missing)}; "
                    "rerun with --install-deps, or install them yourself",
                    file=sys.stderr,
                )
                return 2
            install(python, env_info, missing)
            env_info = probe(python)
        env_info["redis_server"] = _redis_server_version()
        env_info["celery_fair_source"] = _source_state(env_info["celery_fair_path"])
        deselect = {} if args.all else dict(DESELECT)
        if args.worker == "subprocess":
            deselect.update(DESELECT_SUBPROCESS)
        deselect.update({nodeid: "--deselect" for nodeid in args.deselect})
        runs: dict[str, dict[str, Any]] = {}
        for mode in args.runs:
            runs[mode] = run_half(mode, python, env_info, tree, modules, deselect, args, work)
        name = args.name or f"celery_integration_{celery_version}" + (
            "_subprocess" if args.worker == "subprocess" else ""
        )
        command = _command(args)
        settings = {
            "modules": modules,
            "modules_missing": missing_modules,
            "timeout_per_test_s": args.timeout,
            "run_timeout_s": args.run_timeout,
            "reruns": "as marked by Celery (pytest-rerunfailures)" if args.reruns else "off",
            "deselected": deselect,
            "sdist": Path(sdist).name,
            "worker": args.worker,
            "worker_args": args.worker_args,
        }
        result = compare(runs, env_info, settings, command)
        _write(args.out_dir, name, result, render_markdown(result))
        for d in result["differences"]:
            outcomes = ", ".join(f"{mode} {outcome}" for mode, outcome in d["outcomes"].items())
            kinds = ", ".join(f"{mode}: {kind}" for mode, kind in d["kinds"].items())
            print(f"differs: {d['test']}: {outcomes} ({kinds})")
        return 1 if any(result["regressions"].values()) else 0
    except BaseException:
        keep = True  # for a look at what went wrong
        raise
    finally:
        if keep:
            print(f"kept {work} (sources, pytest logs, raw outcomes)")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    default_python = REPO / ".venv" / "bin" / "python"
    p = argparse.ArgumentParser(
        prog="python -m bench.celery_integration", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--python",
        default=str(default_python if default_python.exists() else sys.executable),
        help="interpreter whose Celery is tested (default: the project's .venv)",
    )
    p.add_argument(
        "--modules",
        nargs="+",
        default=list(MODULES),
        metavar="MODULE",
        help="modules of t/integration, or single tests (test_tasks.py::test_tasks::test_x)",
    )
    p.add_argument("--timeout", type=float, default=60, help="seconds per test (default 60)")
    p.add_argument(
        "--run-timeout",
        type=float,
        default=1200,
        help="seconds per run before it is interrupted (default 1200)",
    )
    p.add_argument(
        "--runs",
        nargs="+",
        choices=RUNS,
        default=list(RUNS),
        help="which runs, in order (default: plain fair keyed); each is compared with plain",
    )
    p.add_argument(
        "--worker",
        choices=("subprocess", "embedded"),
        default="subprocess",
        help="the suite's shared worker: a `celery worker` subprocess with Celery's defaults "
        "(default), or Celery's embedded test worker (mingle, gossip, heartbeat off)",
    )
    p.add_argument(
        "--worker-args",
        default="",
        metavar="ARGS",
        help="more `celery worker` arguments for the subprocess worker, e.g. '-c 1'",
    )
    p.add_argument(
        "--no-reruns",
        dest="reruns",
        action="store_false",
        help="disable pytest-rerunfailures (Celery marks some tests flaky, rerun up to 5x)",
    )
    p.add_argument(
        "--deselect", action="append", default=[], metavar="NODEID", help="skip this test too"
    )
    p.add_argument("--all", action="store_true", help="do not deselect the slow tests (DESELECT)")
    p.add_argument("--install-deps", action="store_true", help="install missing test deps")
    p.add_argument("--sdist", help="use this celery-<version>.tar.gz instead of downloading")
    p.add_argument("--name", help="result file name (default celery_integration_<version>)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    return p


def _command(args: argparse.Namespace) -> str:
    argv = ["python", "-m", "bench.celery_integration", *sys.argv[1:]]
    return " ".join(shlex.quote(a) for a in argv)


# The target interpreter ------------------------------------------------------


def probe(python: str) -> dict[str, Any]:
    # Not from the repository root: `python -c` puts the working directory first
    # on sys.path, and pytest will run in the extracted tree.
    out = subprocess.run(
        [python, "-c", _PROBE], check=True, capture_output=True, text=True, cwd="/"
    )
    return dict(json.loads(out.stdout))


def missing_deps(env_info: dict[str, Any], tree: Path, *, reruns: bool) -> list[str]:
    """The test-only packages the target lacks, as pip requirements."""
    dists = env_info["dists"]
    missing = []
    if not dists["pytest"]:
        missing.append("pytest")
    if not dists["pytest-timeout"]:
        missing.append("pytest-timeout")
    if reruns and not dists["pytest-rerunfailures"]:
        missing.append("pytest-rerunfailures")
    tasks = (tree / "t" / "integration" / "tasks.py").read_text(errors="replace")
    if "pydantic" in tasks and not dists["pydantic"]:
        missing.append("pydantic")
    worker_tests = tree / "t" / "integration" / "test_worker.py"
    if (
        worker_tests.exists()
        and "import django" in worker_tests.read_text(errors="replace")
        and not dists["django"]
    ):
        missing.append("django")
    pytest_major = int((dists["pytest"] or "0").split(".")[0])
    if pytest_major < 9 and not dists["pytest-subtests"]:
        missing.append("pytest-subtests")  # built into pytest from 9.0
    return missing


def install(python: str, env_info: dict[str, Any], packages: list[str]) -> None:
    """Install ``packages`` into the target, keeping its Celery and pytest versions."""
    dists = env_info["dists"]
    pins = [f"{name}=={dists[name]}" for name in ("celery", "kombu", "pytest") if dists[name]]
    if env_info["pip"]:
        cmd = [python, "-m", "pip", "install", *packages, *pins]
    elif shutil.which("uv"):
        cmd = ["uv", "pip", "install", "--python", python, *packages, *pins]
    else:
        raise SystemExit(f"{python} has no pip and uv is not on PATH: install {packages}")
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def fixtures_plugin_args(env_info: dict[str, Any]) -> list[str]:
    """Load ``celery.contrib.pytest`` unless an installed plugin already provides it."""
    values = {entry.split("=", 1)[1] for entry in env_info["pytest11"]}
    if values & {"celery.contrib.pytest", "pytest_celery.plugin", "pytest_celery"}:
        return []
    return ["-p", "celery.contrib.pytest"]


def _source_state(celery_fair_init: str | None) -> str | None:
    """The commit of the celery_fair being tested, and whether it has local edits."""
    if celery_fair_init is None:
        return None
    package = Path(celery_fair_init).parent
    git = ["git", "-C", str(package.parent)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", str(package)], capture_output=True, text=True
    ).stdout.strip()
    return head.stdout.strip() + (" with uncommitted changes" if dirty else "")


def _redis_server_version() -> str:
    exe = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")
    if exe is None:
        return "not found"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), out.strip())


# Celery's sources --------------------------------------------------------------


def download_sdist(version: str, work: Path) -> Path:
    """``pip download --no-binary :all: --no-deps celery==<version>``."""
    dest = work / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"] if _has_pip(sys.executable) else ["pip"]
    cmd = [*pip, "download", "--no-binary", ":all:", "--no-deps", f"celery=={version}"]
    cmd += ["-d", str(dest), "-q"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    found = sorted(dest.glob("celery-*.tar.gz"))
    if not found:
        raise SystemExit(f"pip download left no celery sdist in {dest}")
    return found[0]


def _has_pip(python: str) -> bool:
    return subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0


def extract_tests(sdist: Path, dest: Path) -> Path | None:
    """Extract ``t/`` and ``pyproject.toml``/``setup.cfg``; None if there is no t/integration."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 2 or not (member.isfile() or member.isdir()):
                continue
            rel = Path(*parts[1:])
            if rel.parts[0] == "t" or str(rel) in ("pyproject.toml", "setup.cfg"):
                member.name = str(rel)
                members.append(member)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # pragma: no cover  (Python < 3.10.12)
            tar.extractall(dest, members=members)
    return dest if (dest / "t" / "integration" / "conftest.py").exists() else None


# One half ----------------------------------------------------------------------


def run_half(
    mode: str,
    python: str,
    env_info: dict[str, Any],
    tree: Path,
    modules: list[str],
    deselect: dict[str, str],
    args: argparse.Namespace,
    work: Path,
) -> dict[str, Any]:
    """Run pytest once (``mode``: plain, fair or keyed) against a fresh private Redis."""
    report = work / f"outcomes_{mode}.jsonl"
    log = work / f"pytest_{mode}.log"
    cmd = [
        python,
        "-m",
        "pytest",
        "-p",
        PLUGIN,
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        *fixtures_plugin_args(env_info),
        *([] if args.reruns else ["-p", "no:rerunfailures"]),
        "--timeout",
        str(args.timeout),
        "--celery-fair-timeout-cap",
        str(args.timeout),
        "--celery-fair-report",
        str(report),
        "-q",
        "-rfE",
        "--color=no",
        *(["--celery-fair-install"] if mode in ("fair", "keyed") else []),
        *(["--celery-fair-keys"] if mode == "keyed" else []),
        "--celery-fair-worker",
        args.worker,
        "--celery-fair-worker-dir",
        str(work / f"worker_{mode}"),
        *(["--celery-fair-worker-args", args.worker_args] if args.worker_args else []),
        *[f"t/integration/{m}" for m in modules],
    ]
    for nodeid in deselect:
        cmd += ["--celery-fair-deselect", nodeid]
    with RedisServer() as redis:
        env = dict(os.environ)
        env.update(
            TEST_BROKER=redis.url,
            TEST_BACKEND=redis.url,
            REDIS_HOST="127.0.0.1",
            REDIS_PORT=str(redis.port),
            PYTHONPATH=os.pathsep.join(
                p for p in (str(PLUGIN_DIR), env.get("PYTHONPATH", "")) if p
            ),
            # As if the venv were activated: test_worker.py runs `celery worker`.
            PATH=os.pathsep.join(p for p in (str(Path(python).parent), env.get("PATH", "")) if p),
        )
        print(f"[{mode}] redis {redis.url}; {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        timed_out = _run_bounded(cmd, tree, env, log, args.run_timeout)
        wall = time.monotonic() - started
    tests, meta = _read_outcomes(report)
    tail = log.read_text(errors="replace").splitlines()[-1:] if log.exists() else []
    print(f"[{mode}] {wall:.0f} s: {tail[0] if tail else 'no output'}", flush=True)
    return {
        "tests": tests,
        "meta": meta,
        "wall_s": round(wall, 1),
        "timed_out": timed_out,
        "summary_line": tail[0] if tail else None,
    }


def _run_bounded(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, limit: float) -> bool:
    """Run ``cmd`` in its own session; interrupt it (SIGINT, then kill) after ``limit`` s."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGINT)  # pytest still writes its session summary
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        finally:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        # Pool processes the run left behind are in the session we started.
        _signal_group(proc.pid, signal.SIGKILL)
    return timed_out


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _read_outcomes(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    tests: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    if not path.exists():
        return tests, meta
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "meta" in rec:
            meta = rec["meta"]
        else:
            tests[rec.pop("nodeid")] = rec
    return tests, meta


def _write(out_dir: Path, name: str, data: dict[str, Any], markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out_dir / f"{name}.md").write_text(markdown)
    print(f"wrote {out_dir / name}.json and .md")
