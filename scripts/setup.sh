#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian 12 machine: PostgreSQL server binaries, Java 17,
# the PostgreSQL JDBC driver for Spark's Iceberg JDBC catalog, and the Python venv in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
[ -x /usr/lib/postgresql/15/bin/initdb ] || command -v initdb >/dev/null || need_apt+=(postgresql-15)
command -v java >/dev/null || need_apt+=(openjdk-17-jre-headless)
[ -f /usr/share/java/postgresql.jar ] || need_apt+=(libpostgresql-jdbc-java)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip
# readers: DuckDB and Daft, the independent Iceberg readers of tests/test_independent_readers.py.
.venv/bin/pip install -q -e '.[dev,readers]'
echo "setup complete: $(.venv/bin/python --version), $(java -version 2>&1 | head -1)"
