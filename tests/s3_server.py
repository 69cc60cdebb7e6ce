"""A real S3-protocol server on loopback for tests: moto's ThreadedMotoServer on 127.0.0.1, port 0.

Not a conftest: a test module that needs S3 imports the fixtures it uses,

    from s3_server import s3, s3_bucket  # noqa: F401  (pytest fixtures)

`s3` (session): the server, its endpoint and the environment a client needs (AWS_ENDPOINT_URL, dummy keys,
AWS_DEFAULT_REGION — never region_name, which breaks s3fs's bucket handling against moto). The variables
are also set in this process, so s3fs/boto3 in the test itself find the server. `s3.stop()` / `s3.start()`
take the server down and bring it back on the same port (its objects survive: moto keeps them in this
process). `s3.enforce_auth()` makes the server check credentials, as AWS does.
`s3_bucket` (function): a fresh bucket name, created on the server.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import pytest

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_counter = itertools.count()


class S3Server:
    def __init__(self) -> None:
        self.port = 0
        self._server = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        return {**_ENV, "AWS_ENDPOINT_URL": self.endpoint, **extra}

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def fs(self):
        """A fresh s3fs filesystem on this server (no instance cache, no listing cache)."""
        import s3fs

        return s3fs.S3FileSystem(
            key="testing",
            secret="testing",
            skip_instance_cache=True,
            use_listings_cache=False,
            client_kwargs={"endpoint_url": self.endpoint},
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    @contextlib.contextmanager
    def enforce_auth(self):
        """Inside: requests must be signed with keys the server knows (none are created, so all fail)."""
        from moto import settings
        from moto.core.authorization import ActionAuthenticatorMixin

        before = settings.INITIAL_NO_AUTH_ACTION_COUNT
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        ActionAuthenticatorMixin.request_count = 0
        try:
            yield
        finally:
            settings.INITIAL_NO_AUTH_ACTION_COUNT = before


@pytest.fixture(scope="session")
def s3():
    saved = {k: os.environ.get(k) for k in [*_ENV, "AWS_ENDPOINT_URL"]}
    server = S3Server()
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_bucket(s3) -> str:
    return s3.create_bucket(f"bigclip-test-{os.getpid()}-{next(_counter)}")
