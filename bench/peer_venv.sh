#!/usr/bin/env bash
# Makes .venv-peer: a venv apart from .venv for the peer benchmark (bench/peer_dlt.py), so that dlt's
# dependencies never touch the project's pins. Idempotent: a venv that already has the pinned
# versions is left alone. PYTHON picks the interpreter (default python3.11, else python3).
#
#   dlt[sql-database,pyiceberg]  dlt's sql_database source (SQLAlchemy) and its Iceberg support
#                                (pyiceberg, pyiceberg-core, pyarrow). The filesystem destination
#                                itself ships with dlt; the `filesystem` extra only adds s3fs/botocore,
#                                which a file:// bucket does not need.
#   psycopg2-binary              the driver of the postgresql+psycopg2:// URL peer_dlt.py gives SQLAlchemy
#                                (SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3 instead).
#   connectorx                   the `connectorx` table backend (its own Rust PostgreSQL client).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-peer
PINS=(
  "dlt[sql-database,pyiceberg]==1.31.0"
  "connectorx==0.4.6"
  "psycopg2-binary==2.9.13"
  "pyiceberg==0.12.0"
  "pyiceberg-core==0.11.0"
  "pyarrow==26.0.1"
  "sqlalchemy==2.1.9"
)

have_pins() {
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" - "${PINS[@]}" <<'PY'
import re
import sys
from importlib.metadata import PackageNotFoundError, version

for pin in sys.argv[1:]:
    name, wanted = re.sub(r"\[.*\]", "", pin).split("==")
    try:
        if version(name) != wanted:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
}

if have_pins; then
  exit 0
fi
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PINS[@]}"
have_pins || { echo "peer_venv.sh: $VENV still lacks the pinned versions" >&2; exit 1; }
echo "peer venv ready: $VENV ($("$VENV/bin/python" --version), dlt $("$VENV/bin/python" -c 'import dlt; print(dlt.__version__)'))"
