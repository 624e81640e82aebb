"""The object store holding staged files: a local directory (file://) or an S3 prefix (s3://)."""

from __future__ import annotations

import builtins
import contextlib
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from pyarrow import fs

from ..config import StagingConfig
from ..errors import StagingError
from ..paths import digest_segment

# Uploads at once to S3 when a flush stages many files (each PUT mostly waits on the network).
PARALLEL_PUTS = 8


def table_location(table: str) -> str:
    """The staging folder of ``table`` (its ``schema.table`` key): one path segment that no other
    table's folder can equal, contain or sit in, and that cannot leave the staging root, whatever the
    table's name holds (``a.b`` and ``a.b/c``, ``../..``, characters special to S3 keys)."""
    return digest_segment(table)


def legacy_table_location(table: str) -> str | None:
    """The folder the first staging layout gave ``table`` (its raw key), where files staged before
    the layout changed may still lie; None when that path was not confined to one folder of its own
    under the staging root (a ``.``, ``..`` or empty segment): such files are left alone."""
    segments = table.split("/")
    if any(segment in ("", ".", "..") for segment in segments):
        return None
    return table


def staged_file_key(location: str, lsn: int) -> str:
    """Where a staged file whose last transaction's commit ends at ``lsn`` goes in the table folder
    ``location`` (see :func:`table_location`): ``<location>/<LSN hex>-<id>.parquet``. The flusher stages
    only commits past the flushed LSN, so a file not registered yet is always named above it."""
    return f"{location}/{lsn:016X}-{uuid.uuid4().hex[:12]}.parquet"


def merge_batch_prefix(location: str) -> str:
    """Where the materializer stages a prepared batch of the table whose folder is ``location`` for
    Spark to read (deleted after the merge; a crash can leave one, which maintenance deletes)."""
    return f"_batches/{location}/"


def staged_file_lsn(key: str) -> int | None:
    """The LSN in a staged file's key (None for keys not named by :func:`staged_file_key`)."""
    try:
        return int(key.rsplit("/", 1)[-1].split("-", 1)[0], 16)
    except ValueError:
        return None


class ObjectStore:
    """Relative keys under the staging root; the same code serves file:// and s3://."""

    def __init__(self, config: StagingConfig) -> None:
        parsed = urlparse(config.url)
        if parsed.scheme == "file":
            self.filesystem: fs.FileSystem = fs.LocalFileSystem()
            self.root = parsed.path.rstrip("/")
        else:
            access_key, secret_key = config.s3.credentials()
            options: dict[str, object] = {"region": config.s3.region}
            if config.s3.endpoint:
                endpoint = urlparse(config.s3.endpoint)
                options["endpoint_override"] = endpoint.netloc or config.s3.endpoint
                options["scheme"] = endpoint.scheme or "https"
            if access_key and secret_key:
                options["access_key"] = access_key
                options["secret_key"] = secret_key
            if config.s3.path_style:
                options["force_virtual_addressing"] = False
            self.filesystem = fs.S3FileSystem(**options)
            self.root = f"{parsed.netloc}{parsed.path}".rstrip("/")
        self.url = config.url
        self._local = isinstance(self.filesystem, fs.LocalFileSystem)
        # Where the store is, for errors: the endpoint is what an operator checks first.
        self.location = (
            f"{config.url} (S3 endpoint {config.s3.endpoint or 'of region ' + config.s3.region})"
            if parsed.scheme == "s3"
            else config.url
        )

    def _full(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _failed(self, action: str, key: str, exc: OSError) -> StagingError:
        # pyarrow's S3 errors carry the AWS error and curl detail, never the credentials.
        return StagingError(f"cannot {action} staged file {key} in {self.location}: {exc}")

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` (durably enough to be read back by another process).

        On failure (store unreachable, disk full, access denied) no partial file is left behind and a
        :class:`StagingError` names the store and the reason.
        """
        try:
            if self._local:  # S3 has no directories: creating one there costs requests of its own
                self.filesystem.create_dir(self._full(key).rsplit("/", 1)[0], recursive=True)
            with self.filesystem.open_output_stream(self._full(key)) as stream:
                stream.write(data)
        except OSError as exc:
            if self._local:  # an S3 PUT never leaves half an object
                with contextlib.suppress(OSError):
                    self.filesystem.delete_file(self._full(key))  # a truncated file would only waste space
            raise self._failed("write", key, exc) from exc

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        """:meth:`put` each ``(key, data)``; on S3 up to :data:`PARALLEL_PUTS` at once, since a PUT
        waits on the network (a flush over hundreds of tables uploads a file for each). Returns once
        all are written; the first failure is raised after the others finished."""
        if self._local or len(items) < 2:
            for key, data in items:
                self.put(key, data)
            return
        with ThreadPoolExecutor(min(PARALLEL_PUTS, len(items)), thread_name_prefix="staging-put") as pool:
            for future in [pool.submit(self.put, key, data) for key, data in items]:
                future.result()

    def get(self, key: str) -> bytes:
        """The bytes at ``key``; a :class:`StagingError` names the store when it cannot be read."""
        try:
            with self.filesystem.open_input_stream(self._full(key)) as stream:
                return stream.read()
        except OSError as exc:
            raise self._failed("read", key, exc) from exc

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filesystem.delete_file(self._full(key))

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (recursive)."""
        return sorted(self.modified(prefix))

    def modified(self, prefix: str = "", recursive: bool = True) -> dict[str, float]:
        """Keys under ``prefix`` with the time each was last written (epoch seconds); with
        ``recursive=False`` only the files directly in the folder ``prefix``, none of its subfolders'."""
        selector = fs.FileSelector(self._full(prefix).rstrip("/"), recursive=recursive, allow_not_found=True)
        base = len(self.root) + 1
        return {
            info.path[base:]: info.mtime.timestamp() if info.mtime else 0.0
            for info in self.filesystem.get_file_info(selector)
            if info.is_file
        }

    def files_in(self, folder: str) -> builtins.list[str]:
        """Keys of the files directly in ``folder`` (a table's location): exactly that folder, never
        a subfolder, so one table's listing cannot reach another's files."""
        return sorted(self.modified(f"{folder}/", recursive=False))

    def uri(self, key: str) -> str:
        """The key as a URL (for readers such as Spark)."""
        return f"{self.url}/{key}"
