"""A real S3 API server on loopback for the tests (moto's server mode), and a proxy in front of it
that holds or refuses chosen uploads: how a test stops an upload half way, or makes the storage
fail, without patching the client."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto_server on 127.0.0.1 (or on a test host of tests/hosts.py) with a bucket "bkt";
    `env()` is what a training process needs to use it. With `users`, requests after the set-up
    need real credentials: `keys[name]` for each user, who may do the actions listed for them."""

    def __init__(self, users: dict[str, list[str]] | None = None, host: Any = None) -> None:
        self.port = free_port() if host is None else 5000
        address = "127.0.0.1" if host is None else host.address
        self.endpoint = f"http://{address}:{self.port}"
        # Random keys: a test can look for them in everything a run leaves behind.
        self.key_id, self.secret = f"AKIA{uuid.uuid4().hex[:16].upper()}", uuid.uuid4().hex
        self.keys: dict[str, tuple[str, str]] = {}
        env = {"INITIAL_NO_AUTH_ACTION_COUNT": str(1 + 3 * len(users))} if users else {}
        start = subprocess.Popen if host is None else host.popen
        self.process = start(
            [sys.executable, "-m", "moto.server", "-H", address, "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**_environ(), **env})
        if host is not None:  # out of this namespace's reach: set up from the host itself
            made = host.run([sys.executable, "-c", _MAKE_BUCKET, self.endpoint, self.key_id,
                             self.secret], capture_output=True, text=True, timeout=60)
            assert made.returncode == 0, made.stderr
            return
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert self.process.poll() is None, "moto_server did not start"
                assert time.monotonic() < deadline, "moto_server did not answer in 30 s"
                time.sleep(0.1)
        self._client("s3").create_bucket(Bucket="bkt")  # the first free action
        for name, actions in (users or {}).items():  # three free actions each
            iam = self._client("iam")
            iam.create_user(UserName=name)
            key = iam.create_access_key(UserName=name)["AccessKey"]
            iam.put_user_policy(UserName=name, PolicyName="test", PolicyDocument=json.dumps(
                {"Version": "2012-10-17",
                 "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
            self.keys[name] = (key["AccessKeyId"], key["SecretAccessKey"])

    def _client(self, service: str) -> Any:
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.key_id, aws_secret_access_key=self.secret)

    def make_bucket(self, name: str) -> None:
        self._client("s3").create_bucket(Bucket=name)

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": self.key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1"}

    def fs(self, endpoint: str | None = None) -> Any:
        """An s3fs filesystem on this server (or a Proxy's endpoint) that sees every change at
        once."""
        import s3fs

        return s3fs.S3FileSystem(key=self.key_id, secret=self.secret, skip_instance_cache=True,
                                 use_listings_cache=False,
                                 client_kwargs={"endpoint_url": endpoint or self.endpoint,
                                                "region_name": "us-east-1"})

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


_MAKE_BUCKET = """
import sys, time, boto3
endpoint, key, secret = sys.argv[1:]
s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key,
                  aws_secret_access_key=secret)
for attempt in range(300):
    try:
        s3.create_bucket(Bucket="bkt")
        break
    except Exception:
        time.sleep(0.1)
else:
    raise SystemExit("moto_server did not answer in 30 s")
"""


def _environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


class Proxy(ThreadingHTTPServer):
    """Forwards every request to `target` (host, port). An upload (PUT or POST) whose path holds
    `hold_word` waits, and is never forwarded (`held` is set once one waits), and so does a GET
    whose path holds `hold_get` (a silent endpoint); one whose path holds `refuse_word` is
    answered 403 AccessDenied (counted in `refused`)."""

    daemon_threads = True

    def __init__(self, target: tuple[str, int], hold_word: str = "",
                 refuse_word: str = "", hold_get: str = "") -> None:
        super().__init__(("127.0.0.1", 0), _Forward)
        self.target, self.hold_word, self.refuse_word = target, hold_word, refuse_word
        self.hold_get = hold_get
        self.held, self.released = threading.Event(), threading.Event()
        self.refused = 0
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.released.set()
        self.shutdown()
        self.server_close()


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Proxy

    def log_message(self, *args: Any) -> None:
        pass

    def _body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                chunk = self.rfile.read(size + 2)[:size]
                if not size:
                    return data
                data += chunk
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else None

    def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response(status)
        for key, value in headers:
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        length = dict((k.lower(), v) for k, v in headers).get("content-length", len(data))
        self.send_header("Content-Length", str(length if self.command == "HEAD" else len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _any(self) -> None:
        body, proxy = self._body(), self.server
        upload = self.command in ("PUT", "POST")
        held = proxy.hold_get if self.command == "GET" else proxy.hold_word if upload else ""
        if held and held in self.path:
            proxy.held.set()
            proxy.released.wait()
            self.close_connection = True
            return
        if upload and proxy.refuse_word and proxy.refuse_word in self.path:
            proxy.refused += 1
            self._answer(403, [("Content-Type", "application/xml")],
                         b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied"
                         b"</Code><Message>Access Denied</Message></Error>")
            return
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("transfer-encoding", "connection", "content-length")}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        connection = http.client.HTTPConnection(*proxy.target, timeout=60)
        connection.request(self.command, self.path, body=body, headers=headers)
        response = connection.getresponse()
        self._answer(response.status, response.getheaders(), response.read())
        connection.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any
