"""A small threaded HTTP/1.1 server on the standard library, shared by the
``mooncake_http_metadata_server`` and ``mc_store_rest_server`` commands.

A handler class names its routes; each request is answered with one
``(status, content_type, body)`` triple. Request bodies (``Content-Length`` or
chunked) are limited, as aiohttp limits them for upstream's servers.
"""

import http.server
import logging
import socketserver
import threading
import urllib.parse

log = logging.getLogger("mooncake.http")

#: Largest chunk-size line accepted in a chunked body.
_MAX_LINE = 1024


class BodyTooLarge(Exception):
    """The request body is over the server's limit (answered with 413)."""


class BadBody(Exception):
    """The request body framing is malformed (answered with 400)."""


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """One thread per connection; threads do not keep the process alive."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler, app):
        self.app = app
        super().__init__(address, handler)


class Handler(http.server.BaseHTTPRequestHandler):
    """Dispatches every method to ``self.server.app.handle(method, path, query, read_body)``,
    which returns ``(status, content_type, body_bytes)``."""

    protocol_version = "HTTP/1.1"
    server_version = "mooncake-rs"
    sys_version = ""

    def _dispatch(self):
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        app = self.server.app
        try:
            status, content_type, body = app.handle(self.command, url.path, query, self._read_body)
        except BodyTooLarge:
            status, content_type, body = 413, "text/plain", b"Request Entity Too Large"
            self.close_connection = True
        except BadBody as error:
            status, content_type, body = 400, "text/plain", str(error).encode()
            self.close_connection = True
        except Exception:  # a bug in a handler: answer, log, keep serving
            log.exception("%s %s failed", self.command, self.path)
            status, content_type, body = 500, "text/plain", b"500 Internal Server Error"
        if not getattr(self, "_body_read", True):
            # An unread body would be taken for the next request on this connection.
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _read_body(self):
        """The request body (``BodyTooLarge``, ``BadBody`` when it cannot be taken)."""
        limit = self.server.app.max_body
        self._body_read = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked(limit)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise BadBody("bad Content-Length") from None
        if length < 0:
            raise BadBody("bad Content-Length")
        if length > limit:
            self._body_read = False
            raise BodyTooLarge()
        return self.rfile.read(length)

    def _read_chunked(self, limit):
        parts = []
        total = 0
        while True:
            line = self.rfile.readline(_MAX_LINE)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise BadBody("bad chunk size") from None
            if size == 0:
                while self.rfile.readline(_MAX_LINE) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            total += size
            if total > limit:
                self._body_read = False
                raise BodyTooLarge()
            parts.append(self.rfile.read(size))
            self.rfile.readline(_MAX_LINE)

    def _begin(self):
        # A body the handler did not read must not be parsed as the next request.
        has_body = self.headers.get("Content-Length", "0") not in ("", "0") or "Transfer-Encoding" in self.headers
        self._body_read = not has_body
        self._dispatch()

    do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _begin

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        log.info("%s - %s", self.address_string(), format % args)


def serve_in_thread(app, host, port):
    """Binds ``host:port`` (``OSError`` when it cannot) and serves ``app`` on a daemon
    thread; returns the server (``server.server_address`` has the port bound)."""
    server = Server((host, port), Handler, app)
    thread = threading.Thread(target=server.serve_forever, name="mooncake-http", daemon=True)
    thread.start()
    server.thread = thread
    return server


def stop(server, timeout=2.0):
    """Stops a server started by :func:`serve_in_thread` and closes its socket."""
    server.shutdown()
    server.server_close()
    server.thread.join(timeout)
