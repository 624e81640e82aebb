"""The Spark session the merges run on, built by the engine from the pipeline's ``spark`` section."""

from typing import Any

from dagster import ConfigurableResource, ResourceDependency

from pg2iceberg_dagster.pipeline import build_spark_session, warm_spark_session

from .pipeline import Pg2IcebergResource


class SparkResource(ConfigurableResource):
    """The session of one run: the engine's settings (catalog secrets resolved at run time, which
    ``PySparkResource(spark_config=...)`` cannot do with EnvVar). With ``spark.warm_server`` (the
    default) the run attaches to the pipeline's long-lived Spark driver on this machine, started by
    the first run; otherwise it starts a JVM tuned to live for one merge."""

    pg2iceberg: ResourceDependency[Pg2IcebergResource]

    def get_session(self) -> Any:
        config = self.pg2iceberg.load_config()
        if config.spark.warm_server and not config.spark.remote:
            return warm_spark_session(config)
        return build_spark_session(config, short_lived=True)
