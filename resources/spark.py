"""The Spark session the merges run on, through dagster-pyspark, configured from the pipeline."""

import os
from typing import Any

from dagster import ConfigurableResource, ResourceDependency
from dagster_pyspark.resources import spark_session_from_config

from pg2iceberg_dagster.materializer.spark import SHORT_LIVED_CONF, build_spark_session, py4j_quiet, spark_conf

from .pipeline import Pg2IcebergResource


class SparkResource(ConfigurableResource):
    """Builds the session from the pipeline's ``spark`` section (catalog secrets resolved at run time,
    which ``PySparkResource(spark_config=...)`` cannot do with EnvVar)."""

    pg2iceberg: ResourceDependency[Pg2IcebergResource]

    def get_session(self) -> Any:
        config = self.pg2iceberg.load_config()
        if config.spark.remote:
            return build_spark_session(config)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        with py4j_quiet():  # the conf carries the catalog password; py4j's DEBUG log would show it
            # A run's JVM serves one merge: short-lived settings unless the config's spark.conf says otherwise.
            conf = {**SHORT_LIVED_CONF, "spark.master": config.spark.master, **spark_conf(config)}
            session = spark_session_from_config(conf)
        session.sparkContext.setLogLevel("ERROR")
        return session
