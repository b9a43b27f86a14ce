"""S3 for pyarrow and delta-rs, configured from Spark's own S3A settings.

A session that reaches S3 (or an S3-compatible server) through Spark already says where and
how in ``spark.hadoop.fs.s3a.*``. Those keys are the one place spark_ckpt takes its S3
configuration from too, so that Spark, pyarrow and delta-rs see the same store:

=====================================================  ==========================================
Spark key                                              used for
=====================================================  ==========================================
``spark.hadoop.fs.s3a.endpoint``                       pyarrow's ``endpoint_override``, delta-rs's
                                                       ``AWS_ENDPOINT_URL``
``spark.hadoop.fs.s3a.connection.ssl.enabled``         ``http`` when false (an endpoint without a
                                                       scheme); an ``http://`` endpoint says it too
``spark.hadoop.fs.s3a.path.style.access``              path-style requests (else virtual hosts)
``spark.hadoop.fs.s3a.access.key`` / ``secret.key``    static credentials
/ ``session.token``
``spark.hadoop.fs.s3a.endpoint.region``                the region (``us-east-1`` if unset)
=====================================================  ==========================================

With none of them set, pyarrow and delta-rs find the store and credentials themselves (the
``AWS_*`` environment variables, ``~/.aws``, an instance profile), as before.

The driver reads them when a pipeline or batch job binds to its session (:func:`configure`).
Python tasks get the driver's configuration with their parameters (:func:`current` is shipped,
:func:`install` runs in the task), since a Python worker cannot read the Spark conf.

Create-if-absent on S3 is a conditional PUT (``If-None-Match: *``, answered 412 when the
object exists) made with botocore where it is installed (``pip install "spark-ckpt[s3]"``);
delta-rs's commits are conditional PUTs of its own (``conditional_put = etag``). Where a
conditional PUT cannot be made (no botocore, or a server that answers 501), create-if-absent
falls back to check-then-write with a warning naming the guarantee lost, or fails with
``spark.ckpt.storage.conditionalWrites=required``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import Any

from spark_ckpt.errors import ConfigurationError, StorageGuaranteeError

__all__ = ["S3Config", "configure", "current", "delta_options", "install", "put_if_absent",
           "warn_check_then_write"]

log = logging.getLogger(__name__)

S3_SCHEMES = ("s3", "s3a", "s3n")
_PREFIX = "spark.hadoop.fs.s3a."
_POLICY_KEY = "spark.ckpt.storage.conditionalWrites"
_POLICIES = ("auto", "required")


@dataclasses.dataclass(frozen=True, kw_only=True)
class S3Config:
    """Where S3 is and how to sign for it; None fields are left to pyarrow's and delta-rs's
    own discovery (environment, profile, instance metadata)."""

    endpoint: str | None = None  # with its scheme: http://127.0.0.1:9000
    access_key: str | None = None
    secret_key: str | None = dataclasses.field(default=None, repr=False)
    session_token: str | None = dataclasses.field(default=None, repr=False)
    region: str | None = None
    path_style: bool = False
    conditional_writes: str = "auto"  # spark.ckpt.storage.conditionalWrites

    @classmethod
    def from_conf(cls, get: Any) -> S3Config:
        """Read Spark's S3A keys through ``get(key) -> str | None``.

        Raises:
            ConfigurationError: a boolean key that is not true/false, an endpoint with a
                scheme other than http or https, a secret key without its access key (or the
                reverse), an unknown ``spark.ckpt.storage.conditionalWrites``.
        """
        def flag(name: str, default: bool) -> bool:
            raw = get(_PREFIX + name)
            if raw is None:
                return default
            text = str(raw).strip().lower()
            if text not in ("true", "false"):
                raise ConfigurationError(f"{_PREFIX}{name}: expected true or false, found "
                                         f"{raw!r}")
            return text == "true"

        def text(name: str) -> str | None:
            raw = get(_PREFIX + name)
            return str(raw).strip() or None if raw is not None else None

        endpoint = text("endpoint")
        if endpoint is not None:
            scheme, sep, _rest = endpoint.partition("://")
            if not sep:
                ssl = flag("connection.ssl.enabled", True)
                endpoint = f"{'https' if ssl else 'http'}://{endpoint}"
            elif scheme.lower() not in ("http", "https"):
                raise ConfigurationError(f"{_PREFIX}endpoint: expected http:// or https:// "
                                         f"(or a host:port), found {endpoint!r}")
        access, secret = text("access.key"), text("secret.key")
        if (access is None) != (secret is None):
            raise ConfigurationError(
                f"{_PREFIX}access.key and {_PREFIX}secret.key: expected both or neither, "
                f"found only {'access.key' if secret is None else 'secret.key'}")
        policy = str(get(_POLICY_KEY) or "auto").strip().lower()
        if policy not in _POLICIES:
            raise ConfigurationError(f"{_POLICY_KEY}: expected one of {', '.join(_POLICIES)}, "
                                     f"found {policy!r}")
        return cls(endpoint=endpoint, access_key=access, secret_key=secret,
                   session_token=text("session.token"),
                   region=text("endpoint.region") or text("region"),
                   path_style=flag("path.style.access", False), conditional_writes=policy)

    @property
    def http(self) -> bool:
        return bool(self.endpoint and self.endpoint.lower().startswith("http://"))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> S3Config:
        return cls(**json.loads(text))

    def pyarrow_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"region": self.region or "us-east-1",
                              "force_virtual_addressing": not self.path_style}
        if self.endpoint is not None:
            kw["endpoint_override"] = self.endpoint.split("://", 1)[1]
            kw["scheme"] = "http" if self.http else "https"
        if self.access_key is not None:
            kw.update(access_key=self.access_key, secret_key=self.secret_key)
            if self.session_token is not None:
                kw["session_token"] = self.session_token
        return kw

    def delta_options(self) -> dict[str, str]:
        """delta-rs's (object_store's) storage options. Commits are conditional PUTs
        (``conditional_put = etag``): put-if-absent on ``_delta_log/<version>.json`` is what
        makes two writers' commits safe, without a DynamoDB lock or an unsafe rename."""
        out = {"conditional_put": "etag",
               "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false" if self.path_style else "true"}
        if self.endpoint is not None:
            out["AWS_ENDPOINT_URL"] = self.endpoint
            if self.http:
                out["AWS_ALLOW_HTTP"] = "true"
        if self.region is not None or self.endpoint is not None:
            out["AWS_REGION"] = self.region or "us-east-1"
        if self.access_key is not None and self.secret_key is not None:
            out["AWS_ACCESS_KEY_ID"] = self.access_key
            out["AWS_SECRET_ACCESS_KEY"] = self.secret_key
            if self.session_token is not None:
                out["AWS_SESSION_TOKEN"] = self.session_token
        return out


# The process's configuration. Written by the driver's main thread when a pipeline or job
# binds to its session (configure), and by a Python task before it touches storage (install);
# read from any thread. The lock guards the caches built from it.
_lock = threading.Lock()
_config: S3Config | None = None
_filesystems: dict[S3Config, Any] = {}
_clients: dict[S3Config | None, Any] = {}
_warned: set[str] = set()


def configure(conf: Any) -> S3Config | None:
    """Install the S3 configuration of a SparkSession's conf (``spark.conf``, or anything
    with ``get(key, default)``); None, and nothing changed, when it sets no S3A key."""
    def get(key: str) -> Any:
        try:
            return conf.get(key, None)
        except Exception:  # noqa: BLE001 - a conf that refuses a key has no value for it
            return None

    keys = ("endpoint", "access.key", "secret.key", "path.style.access", "endpoint.region")
    if all(get(_PREFIX + k) is None for k in keys) and get(_POLICY_KEY) is None:
        return None
    config = S3Config.from_conf(get)
    install(config)
    return config


def install(config: S3Config | str | None) -> None:
    """Make ``config`` (or its JSON) this process's S3 configuration; None changes nothing."""
    global _config
    if config is None:
        return
    if isinstance(config, str):
        config = S3Config.from_json(config)
    if config != _config:
        if _config is None or config.endpoint != _config.endpoint:
            log.info("S3 configured from Spark's fs.s3a settings: %s", config)
        _config = config


def current() -> S3Config | None:
    """The process's S3 configuration (None: pyarrow's and delta-rs's own discovery)."""
    return _config


def filesystem() -> Any | None:
    """A pyarrow S3FileSystem for the installed configuration (None when there is none)."""
    config = _config
    if config is None:
        return None
    with _lock:
        fs = _filesystems.get(config)
        if fs is None:
            import pyarrow.fs as pafs

            fs = _filesystems[config] = pafs.S3FileSystem(**config.pyarrow_kwargs())
        return fs


def delta_options(uri: str) -> dict[str, str] | None:
    """delta-rs storage options for a table at ``uri``: the installed S3 configuration's for
    an S3 URI (``conditional_put`` even without one), None for any other."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme not in S3_SCHEMES:
        return None
    config = _config
    return config.delta_options() if config is not None else {"conditional_put": "etag"}


def _client() -> Any | None:
    try:
        import botocore.config
        import botocore.session
    except ImportError:
        return None
    config = _config
    with _lock:
        client = _clients.get(config)
        if client is None:
            kw: dict[str, Any] = {"region_name": "us-east-1"}
            if config is not None:
                kw["region_name"] = config.region or "us-east-1"
                if config.endpoint is not None:
                    kw["endpoint_url"] = config.endpoint
                if config.access_key is not None:
                    kw.update(aws_access_key_id=config.access_key,
                              aws_secret_access_key=config.secret_key,
                              aws_session_token=config.session_token)
            style = "path" if config is not None and config.path_style else "auto"
            client = _clients[config] = botocore.session.get_session().create_client(
                "s3", config=botocore.config.Config(s3={"addressing_style": style},
                                                    retries={"max_attempts": 5}), **kw)
        return client


def put_if_absent(path: str, data: bytes) -> bool | None:
    """PUT ``data`` at pyarrow's S3 path ``bucket/key`` only if no object is there.

    Returns True if this call created it, False if an object was already there (412, or
    409 for a concurrent conditional PUT of the same key), None if no conditional PUT could
    be made (no botocore, or the server does not implement ``If-None-Match``): the caller
    falls back to check-then-write after :func:`warn_check_then_write`."""
    client = _client()
    if client is None:
        return None
    from botocore.exceptions import ClientError

    bucket, _, key = path.lstrip("/").partition("/")
    try:
        client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return False
        if code == "NotImplemented" or status == 501:
            return None
        raise
    return True


def warn_check_then_write(where: str, reason: str) -> None:
    """Say, once per store and process, that create-if-absent is check-then-write there: two
    writers racing could both create (the guarantee lost); raise instead with
    ``spark.ckpt.storage.conditionalWrites=required``."""
    message = (f"create-if-absent on {where} is a check then a write ({reason}): two drivers "
               "racing for the same checkpoint metadata, run or attempt number, commit marker "
               "or stop answer could both write it; the Delta fence still decides who commits")
    policy = _config.conditional_writes if _config is not None else "auto"
    if policy == "required":
        raise StorageGuaranteeError(f"{message}. Expected conditional writes "
                                    f"({_POLICY_KEY}=required); set it to auto to accept this")
    if where not in _warned:
        _warned.add(where)
        log.warning("%s", message)
