"""The resources: the pipeline (the engine's config, as a YAML file or inline, with secrets supplied
through Dagster ``EnvVar``) and the Spark session its merges run on."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dagster import ConfigurableResource, ResourceDependency
from dagster_aws.s3 import S3Resource
from pydantic import Field, SecretStr, model_validator

from pg2iceberg_dagster.config import PipelineConfig, PostgresConnection, load_config, parse_config
from pg2iceberg_dagster.pipeline import Pipeline, build_spark_session, warm_spark_session


def _secret(value: str | None) -> SecretStr | None:
    return SecretStr(value) if value else None


class PostgresResource(ConfigurableResource):
    """Connection to the source PostgreSQL; pass the password as ``EnvVar("...")``."""

    host: str = "127.0.0.1"
    port: int = 5432
    dbname: str
    user: str = "postgres"
    password: str | None = Field(default=None, description="use dg.EnvVar; never a literal")

    def connection(self) -> PostgresConnection:
        """The engine's connection settings (the password stays out of every repr)."""
        return PostgresConnection(
            host=self.host, port=self.port, dbname=self.dbname, user=self.user, password=self.password
        )


class Pg2IcebergResource(ConfigurableResource):
    """The replication pipeline described by the YAML file ``config_path``, or by ``config`` inline
    (the same mapping). ``source`` overrides its source connection; ``staging_s3`` (dagster-aws)
    supplies the staged-log store's endpoint, region and credentials."""

    config_path: str | None = None
    config: dict[str, Any] | None = Field(default=None, description="the pipeline config inline, instead of a file")
    source: PostgresResource | None = None
    staging_s3: S3Resource | None = None

    @model_validator(mode="after")
    def _one_config(self) -> "Pg2IcebergResource":
        if (self.config_path is None) == (self.config is None):
            raise ValueError("give the pipeline config as config_path or as config, not both or neither")
        return self

    def load_config(self) -> PipelineConfig:
        """The pipeline config, with the resource's overrides."""
        if self.config is not None:
            config = parse_config(self.config, "the inline pipeline config")
        else:
            assert self.config_path is not None
            config = load_config(self.config_path)
        if self.source is not None:
            config = config.model_copy(update={"source": self.source.connection()})
        if self.staging_s3 is not None:
            s3 = config.staging.s3.model_copy(
                update={
                    "endpoint": self.staging_s3.endpoint_url or config.staging.s3.endpoint,
                    "region": self.staging_s3.region_name or config.staging.s3.region,
                    # model_copy does not validate: wrap the secrets ourselves.
                    "access_key_id": _secret(self.staging_s3.aws_access_key_id),
                    "secret_access_key": _secret(self.staging_s3.aws_secret_access_key),
                }
            )
            config = config.model_copy(update={"staging": config.staging.model_copy(update={"s3": s3})})
        return config

    @contextmanager
    def pipeline(self, spark_factory: Callable[[], Any] | None = None) -> Iterator[Pipeline]:
        """An engine Pipeline for the duration of one step or tick."""
        with Pipeline(self.load_config(), spark_factory=spark_factory, detached_holder=True) as pipeline:
            yield pipeline


class SparkResource(ConfigurableResource):
    """The session of one run: the engine's settings (catalog secrets resolved at run time, which
    ``PySparkResource(spark_config=...)`` cannot do with EnvVar). With ``spark.warm_server`` (the
    default) the run attaches to the pipeline's long-lived Spark driver on this machine, started by
    the first run (not with history tables: see materializer/history.py); otherwise it starts a JVM
    tuned to live for one merge."""

    pg2iceberg: ResourceDependency[Pg2IcebergResource]

    def get_session(self) -> Any:
        """The Spark session for this run."""
        config = self.pg2iceberg.load_config()
        # A warm driver's gateway cannot stamp commit summaries, which history tables record their position in.
        history = any(config.history_for(table) for table in config.tables)
        if config.spark.warm_server and not config.spark.remote and not history:
            return warm_spark_session(config)
        return build_spark_session(config, short_lived=True)
