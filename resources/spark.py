"""The Spark session the merges run on, through dagster-pyspark, configured from the pipeline."""

import os
from typing import Any

from dagster import ConfigurableResource, ResourceDependency
from dagster_pyspark.resources import spark_session_from_config

from pg2iceberg_dagster.materializer.spark import build_spark_session, spark_conf

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
        session = spark_session_from_config({"spark.master": config.spark.master, **spark_conf(config)})
        session.sparkContext.setLogLevel("ERROR")
        return session
