"""The Spark session the merges run on, built by the engine from the pipeline's ``spark`` section."""

from typing import Any

from dagster import ConfigurableResource, ResourceDependency

from pg2iceberg_dagster.pipeline import build_spark_session

from .pipeline import Pg2IcebergResource


class SparkResource(ConfigurableResource):
    """The session of one run: the engine's settings (catalog secrets resolved at run time, which
    ``PySparkResource(spark_config=...)`` cannot do with EnvVar), tuned for a JVM that lives for one
    merge unless the config's ``spark.conf`` says otherwise."""

    pg2iceberg: ResourceDependency[Pg2IcebergResource]

    def get_session(self) -> Any:
        return build_spark_session(self.pg2iceberg.load_config(), short_lived=True)
