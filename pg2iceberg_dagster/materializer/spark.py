"""The Spark session the materializer merges with, on the same Iceberg catalog as pyiceberg."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import signal
import threading
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from ..config import PipelineConfig
from ..errors import ConfigError
from ..iceberg.catalog import spark_catalog_conf

PGJDBC_JAR = "/usr/share/java/postgresql.jar"


def default_jars() -> list[str]:
    """The Iceberg Spark runtime shipped in the snowpark-connect-deps-iceberg wheel and Debian's pgjdbc."""
    spec = find_spec("snowpark_connect_deps_iceberg")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("spark.jars not set and snowpark-connect-deps-iceberg is not installed")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    runtime = sorted(glob.glob(str(package_dir / "jars" / "iceberg-spark-runtime-3.5_2.12-*.jar")))
    if not runtime:
        raise ConfigError(f"no iceberg-spark-runtime-3.5_2.12 jar under {package_dir}")
    jdbc = os.environ.get("PG2ICEBERG_PGJDBC_JAR", PGJDBC_JAR)
    if not Path(jdbc).exists():
        raise ConfigError(f"PostgreSQL JDBC driver not found at {jdbc}; apt-get install libpostgresql-jdbc-java")
    return [runtime[-1], jdbc]


# For a session that lives for one merge (a Dagster run): such a JVM spends most of its short life
# compiling. C1 alone and no whole-stage code generation (Janino) took a cold merge of 30k changes from
# about 45 s to 20 s on 2 cores (bench/freshness.py). A long-lived session (`run`, `materialize`) keeps
# Spark's defaults, which are faster once warm. A key set in the config's spark.conf wins.
SHORT_LIVED_CONF = {
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
    "spark.sql.codegen.wholeStage": "false",
}


def spark_conf(config: PipelineConfig) -> dict[str, str]:
    """Every Spark setting: Iceberg extensions, the catalog (secrets resolved now), user conf last."""
    conf: dict[str, str] = {
        "spark.app.name": config.spark.app_name,
        "spark.sql.extensions": "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions",
        "spark.ui.enabled": "false",
        # The console progress bar writes into every log (CLI, Dagster run logs) without the UI.
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.session.timeZone": "UTC",
        # PostgreSQL's quoted names tell "Name" from name, and so do Iceberg's: Spark must too, or a
        # table with both fails every merge as ambiguous.
        "spark.sql.caseSensitive": "true",
        # Iceberg, PostgreSQL and pyarrow all use the proleptic Gregorian calendar: Spark must not
        # rebase dates and timestamps before 1582 from its old hybrid calendar, nor refuse them.
        **{
            f"spark.sql.parquet.{kind}RebaseModeIn{way}": "CORRECTED"
            for kind in ("datetime", "int96")
            for way in ("Read", "Write")
        },
        **spark_catalog_conf(config),
    }
    if config.spark.packages:
        conf["spark.jars.packages"] = ",".join(config.spark.packages)
    jars = config.spark.jars if config.spark.jars is not None else ([] if config.spark.packages else default_jars())
    if jars:
        conf["spark.jars"] = ",".join(jars)
    conf.update(config.spark.conf)
    return conf


@contextlib.contextmanager
def py4j_quiet() -> Iterator[None]:
    """Keep py4j's loggers at INFO or above: at DEBUG they log every command sent to the JVM, and
    setting the session's conf sends the catalog password."""
    loggers = [logging.getLogger(name) for name in ("py4j", "py4j.java_gateway", "py4j.clientserver")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def keeping_sigint() -> Iterator[None]:
    """Keep the main thread's SIGINT handler across the creation of a SparkContext, which replaces it
    with one raising KeyboardInterrupt: `run` and `stream` stop cleanly on Ctrl-C through their own."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)


def build_spark_session(config: PipelineConfig, short_lived: bool = False) -> Any:
    """Create (or reuse) the SparkSession: ``spark.remote`` for Spark Connect, else ``spark.master``.

    ``short_lived``: the JVM serves one merge (a Dagster run), so :data:`SHORT_LIVED_CONF` applies
    unless the config's ``spark.conf`` says otherwise."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    builder = builder.remote(config.spark.remote) if config.spark.remote else builder.master(config.spark.master)
    settings = spark_conf(config)
    if short_lived and not config.spark.remote:
        settings = {**SHORT_LIVED_CONF, **settings}
    for key, value in settings.items():
        builder = builder.config(key, value)
    with py4j_quiet(), keeping_sigint():
        session = builder.getOrCreate()
    if not config.spark.remote:
        session.sparkContext.setLogLevel("ERROR")
    return session
