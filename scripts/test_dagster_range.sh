#!/usr/bin/env bash
# The lowest Dagster train of the supported range (pyproject: dagster>=1.12,<1.14; .venv runs the highest,
# 1.13.27): a throwaway venv layered over .venv's packages, with the 1.12.0 train installed on top, runs
# the Dagster tests that need no database (the translator, and the component in a create-dagster project
# with dg 1.12). About a minute once pip's cache holds the 1.12.0 wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
LOW=1.12.0      # dagster, dagster-webserver, dagster-dg-cli, create-dagster
LOW_LIB=0.28.0  # dagster-pyspark, dagster-aws (each pins dagster exactly)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
.venv/bin/python -m venv "$tmp/venv"
# The layer's own packages come first on sys.path; then .venv's, then this checkout (as its editable install).
printf '%s\n%s\n' "$(.venv/bin/python -c "$purelib")" "$PWD" >"$("$tmp/venv/bin/python" -c "$purelib")/over-venv.pth"
# pip installs into the layer only what differs from .venv (it never uninstalls outside the layer; its
# conflict report names .venv's dg 1.13 helpers, which the layer does not use): shown only on failure.
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check \
  "dagster==$LOW" "dagster-webserver==$LOW" "dagster-dg-cli==$LOW" "create-dagster==$LOW" \
  "dagster-pyspark==$LOW_LIB" "dagster-aws==$LOW_LIB" >"$tmp/pip.log" 2>&1 || { cat "$tmp/pip.log" >&2; exit 1; }
"$tmp/venv/bin/python" -c 'import dagster; assert dagster.__version__ == "'"$LOW"'", dagster.__version__'
"$tmp/venv/bin/python" -m pytest -p no:cacheprovider -q tests/test_translator.py tests/test_component.py "$@"
