"""The pipeline resource: the engine's YAML config, with secrets supplied through Dagster ``EnvVar``."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dagster import ConfigurableResource
from dagster_aws.s3 import S3Resource
from pydantic import Field, SecretStr

from pg2iceberg_dagster.config import PipelineConfig, PostgresConnection, load_config
from pg2iceberg_dagster.pipeline import Pipeline


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
    """The replication pipeline described by ``config_path``. ``source`` overrides its source connection;
    ``staging_s3`` (dagster-aws) supplies the staged-log store's endpoint, region and credentials."""

    config_path: str
    source: PostgresResource | None = None
    staging_s3: S3Resource | None = None

    def load_config(self) -> PipelineConfig:
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
