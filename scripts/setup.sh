#!/usr/bin/env bash
# Installs everything the demo and the tests need on a fresh Debian machine:
# Debian packages (redis-server, redis-sentinel, rabbitmq-server, a Java runtime, prometheus,
# openssl) when they are missing, then a virtual environment with this package and its extras.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-sentinel >/dev/null 2>&1 || need+=(redis-sentinel)
command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ] || need+=(rabbitmq-server)
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
# promtool tests the alerting rules; a real Prometheus scrapes the dashboard's test run.
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# The TLS tests make their certificates with the openssl command line.
command -v openssl >/dev/null 2>&1 || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "setup: missing ${need[*]}; run as root or install them" >&2
        exit 1
    fi
    echo "setup: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The Debian package starts a system-wide RabbitMQ on the default ports; the
# project runs its own instances on free ports, so the system one is not used.

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e ".[dev,spark,prometheus]"
    rm -f .venv/.installed-*
    touch "$stamp"
fi
