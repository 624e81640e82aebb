#!/usr/bin/env bash
# Quick start, command 2: the test suite (a throwaway PostgreSQL and one Spark session are started by
# the tests themselves). Pytest's exit code 5 ("no tests collected") is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/pytest ] || bash scripts/setup.sh
.venv/bin/ruff check pg2iceberg_dagster assets jobs resources sensors definitions.py tests soak bench || exit 1
.venv/bin/mypy || exit 1  # [tool.mypy] in pyproject.toml says what it checks
DAGSTER_HOME="$(mktemp -d)" PG2ICEBERG_CONFIG="${PG2ICEBERG_CONFIG:-examples/pg2iceberg.yaml}" \
  .venv/bin/dagster definitions validate -w workspace.yaml >/dev/null 2>&1 || { echo "dagster definitions validate failed" >&2; exit 1; }
.venv/bin/pytest -p no:cacheprovider --durations=15 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
# The suite ran on the highest Dagster of the supported range; the Dagster tests again on the lowest.
if ! range_log="$(bash scripts/test_dagster_range.sh 2>&1)"; then
  printf '%s\n' "$range_log" | tail -40 >&2
  echo "the Dagster tests failed on the lowest supported Dagster (scripts/test_dagster_range.sh)" >&2
  exit 1
fi
echo "lowest supported Dagster: $(printf '%s\n' "$range_log" | grep -E '[0-9]+ (passed|failed)' | tail -1)"
exit "$status"
