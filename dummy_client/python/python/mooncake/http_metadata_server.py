"""Upstream's HTTP metadata server (``mooncake_http_metadata_server``): an in-memory
key-value store for transfer-engine metadata, an alternative to etcd.

Only the standard library is used. Requests go to ``/metadata?key=K``:

============================  ===================================================
``GET``                       200 with the stored bytes, or 404 ``metadata not found``
``PUT`` with a body           200 ``metadata updated``; 400 ``Duplicate rpc_meta key
                              not allowed`` when ``K`` contains ``rpc_meta`` and exists
``DELETE``                    200 ``metadata deleted``, or 404 ``metadata not found``
no or blank ``key``           400 ``metadata key is required`` (whatever the method)
any other method              405 ``Method not allowed``
any other path                404
body over 1 MiB               413
============================  ===================================================

Answers are ``application/json`` as upstream's (the texts above are not JSON). The
store lives as long as the process.

Flags (upstream's): ``--port`` (8080), ``--host`` (0.0.0.0: every interface, as
upstream; the store has no authentication, so give ``--host 127.0.0.1`` or a private
address where the network is not trusted), ``--log-level`` (INFO). SIGINT and SIGTERM
stop it with status 0; a port that cannot be bound ends it with status 1.
"""

import argparse
import enum
import logging
import signal
import sys
import threading

from . import _http

log = logging.getLogger(__name__)

# Upstream labels its text answers JSON too (with a charset); values go out as stored.
_JSON = "application/json; charset=utf-8"
_VALUE = "application/json"
#: Largest value accepted (aiohttp's default request limit, which upstream keeps).
MAX_VALUE = 1 << 20


class KVPoll(enum.Enum):
    """State of a :class:`KVBootstrapServer` (upstream's names)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class _MetadataApp:
    """The ``/metadata`` routes over a dict."""

    max_body = MAX_VALUE

    def __init__(self):
        self.store = {}
        self.lock = threading.Lock()

    def handle(self, method, path, query, read_body):
        if path != "/metadata":
            return 404, "text/plain; charset=utf-8", b"404: Not Found"
        key = (query.get("key") or [""])[0].strip()
        if not key:
            return 400, _JSON, b"metadata key is required"
        if method == "GET":
            with self.lock:
                value = self.store.get(key)
            if value is None:
                return 404, _JSON, b"metadata not found"
            return 200, _VALUE, value
        if method == "PUT":
            value = read_body()
            with self.lock:
                if "rpc_meta" in key and key in self.store:
                    return 400, _JSON, b"Duplicate rpc_meta key not allowed"
                self.store[key] = value
            return 200, _JSON, b"metadata updated"
        if method == "DELETE":
            with self.lock:
                if self.store.pop(key, None) is None:
                    return 404, _JSON, b"metadata not found"
            return 200, _JSON, b"metadata deleted"
        return 405, _JSON, b"Method not allowed"


class KVBootstrapServer:
    """The metadata server as an object (upstream's API): ``run()`` binds and serves on
    a background thread, ``poll()`` tells whether it serves, ``close()`` stops it."""

    def __init__(self, port: int, host: str = "0.0.0.0"):
        self.port = port
        self.host = host
        self._app = _MetadataApp()
        self.store = self._app.store
        self._server = None
        self.thread = None

    def run(self):
        """Binds ``host:port`` (``OSError`` when it cannot; port 0 picks a free port,
        then in ``self.port``) and serves on a daemon thread, which is returned."""
        self._server = _http.serve_in_thread(self._app, self.host, self.port)
        self.port = self._server.server_address[1]
        self.thread = self._server.thread
        log.info("HTTP Metadata Server started on %s:%s", self.host, self.port)
        return self.thread

    def close(self):
        """Stops serving (idempotent)."""
        if self._server is not None:
            _http.stop(self._server)
            self._server = None
            log.info("Server thread stopped")

    def poll(self) -> KVPoll:
        """``Success`` while serving, ``Failed`` otherwise."""
        if self.thread is None or not self.thread.is_alive():
            return KVPoll.Failed
        return KVPoll.Success


def parse_args(argv=None):
    """Upstream's flags: ``--port``, ``--host``, ``--log-level``."""
    parser = argparse.ArgumentParser(
        description="HTTP Metadata Server for Mooncake",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=8080, help="Port to listen on")
    parser.add_argument("--host", type=str, default="0.0.0.0", help="Host to bind to")
    parser.add_argument(
        "--log-level",
        type=str,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        default="INFO",
        help="Logging level",
    )
    return parser.parse_args(argv)


def main(argv=None):
    """Entry point of ``mooncake_http_metadata_server``: serves until SIGINT or SIGTERM."""
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s",
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    server = KVBootstrapServer(port=args.port, host=args.host)
    try:
        server.run()
    except OSError as error:
        log.error("cannot listen on %s:%s: %s", args.host, args.port, error)
        return 1
    # Event.wait in slices: a signal handler runs in the main thread between them.
    while not stop.wait(1.0):
        pass
    log.info("Shutting down...")
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
