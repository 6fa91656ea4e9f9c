"""Upstream's store REST service (``mc_store_rest_server``): a store node that joins the
cluster and answers HTTP requests against it, on the standard library only.

Configuration as upstream's: ``--config FILE`` (the JSON of
:class:`mooncake.mooncake_config.MooncakeConfig`) or the ``MOONCAKE_*`` variables, then
``-D key=value`` overrides. The node starts with ``MooncakeDistributedStore.setup``
(retried once a second for ``--max-wait-time`` seconds), then serves on ``--port``
(8080) of every interface, as upstream; ``--host`` (an addition) narrows that.

=============================  ==================================================
``PUT /api/put``               JSON ``{"key", "value"}``: stores the UTF-8 value
``GET /api/get/{key}``         the value (``application/octet-stream``) or 404
``GET /api/exist/{key}``       ``{"exists": true|false}``
``DELETE /api/remove/{key}``   removes the key
``DELETE /api/remove_all``     removes every key
``POST /api/reconfigure``      ``{"mode": "prefill"|"decode", ...}``
``POST /api/mount_shm``,       segment mounting: input is checked as upstream's,
``/api/unmount_shm``,          then answered 501 with a JSON error when the store
``/api/mount``,                answers ``NOT_SUPPORTED`` (mooncake-rs nodes
``/api/unmount``,              contribute exactly their global segment and keep
``/api/unmount_local_disk``    their SSD tier until restarted)
=============================  ==================================================

Answers are JSON (``{"status": "success"}`` or ``{"error": "..."}``) with upstream's
status codes: 400 for bad input, 404 for a missing key, 500 when the store fails,
413 for a body over 100 MiB. SIGINT and SIGTERM close the store and exit with 0.
"""

import argparse
import json
import logging
import signal
import sys
import threading
import time
import urllib.parse

from . import _http
from .mooncake_config import MooncakeConfig

log = logging.getLogger(__name__)

#: Longest ``grace_period_seconds`` that ``/api/unmount_local_disk`` accepts.
_MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS = 3600
#: Largest request body (upstream's aiohttp limit).
MAX_BODY = 100 << 20

_JSON = "application/json; charset=utf-8"


class _Unsupported(Exception):
    """The store lacks the method, or answered ``NOT_SUPPORTED`` (answered with 501)."""


def _not_supported_code():
    from ._store import ERROR_CODES

    return ERROR_CODES["NOT_SUPPORTED"]


def _shm_name_to_path(name):
    """``/dev/shm/<name>`` for a POSIX shared-memory name (``None`` when invalid)."""
    if not isinstance(name, str) or not name:
        return None
    name = name[1:] if name.startswith("/") else name
    if not name or "/" in name or name in (".", ".."):
        return None
    return f"/dev/shm/{name}"


def _answer(status, payload):
    return status, _JSON, json.dumps(payload).encode()


def _error(status, message, **extra):
    return _answer(status, {"error": message, **extra})


class MooncakeStoreService:
    """The store node and its REST routes.

    Unlike upstream's class, the methods are plain (not coroutines): requests are
    served by threads, and the store's calls release the GIL.
    """

    def __init__(self, config_path=None, cli_config=None):
        self.store = None
        self.config = MooncakeConfig.from_file(config_path) if config_path else MooncakeConfig.load_from_env()
        for key, value in (cli_config or {}).items():
            if hasattr(self.config, key):
                setattr(self.config, key, value)
            else:
                log.warning("Ignoring unknown configuration key %r", key)
        log.info("Mooncake configuration loaded")
        # /api/reconfigure state, changed under _state_lock.
        self.current_mode = "prefill"
        self.mounted_segment_ids = []
        self.last_mount_info = {}
        self._state_lock = threading.Lock()
        self._http = None
        self._routes = {
            "/api/reconfigure": ("POST", "RECONFIGURE", self.handle_reconfigure),
            "/api/mount_shm": ("POST", "MOUNT_SHM", self.handle_mount_shm),
            "/api/unmount_shm": ("POST", "UNMOUNT_SHM", self.handle_unmount_shm),
            "/api/mount": ("POST", "MOUNT", self.handle_mount),
            "/api/unmount": ("POST", "UNMOUNT", self.handle_unmount),
            "/api/unmount_local_disk": ("POST", "UNMOUNT_LOCAL_DISK", self.handle_unmount_local_disk),
            "/api/put": ("PUT", "PUT", self.handle_put),
            "/api/remove_all": ("DELETE", "REMOVE_ALL", self.handle_remove_all),
        }
        self._key_routes = {
            "get": ("GET", "GET", self.handle_get),
            "exist": ("GET", "EXIST", self.handle_exist),
            "remove": ("DELETE", "REMOVE", self.handle_remove),
        }

    max_body = MAX_BODY

    # ----- lifecycle -----

    def _setup_settings(self):
        """The ``setup`` dict of upstream's service, from the configuration."""
        c = self.config
        return {
            "local_hostname": c.local_hostname,
            "metadata_server": c.metadata_server,
            "global_segment_size": c.global_segment_size,
            "local_buffer_size": c.local_buffer_size,
            "protocol": c.protocol,
            "rdma_devices": c.device_name,
            "master_server_addr": c.master_server_address,
            "enable_ssd_offload": c.enable_ssd_offload,
            "ssd_offload_path": c.ssd_offload_path,
            "tenant_id": c.tenant_id,
            "enable_client_http_server": c.enable_client_http_server,
            "client_http_port": c.client_http_port,
        }

    def start_store_service(self, max_wait_time=60, shutdown_event=None):
        """Sets the store up, retrying once a second for ``max_wait_time`` seconds or
        until ``shutdown_event`` (a ``threading.Event``) is set; True when it is up."""
        from .store import MooncakeDistributedStore

        start = time.monotonic()
        attempt = 0
        while True:
            if shutdown_event is not None and shutdown_event.is_set():
                log.info("Store startup cancelled by shutdown request")
                self.stop()
                return False
            elapsed = time.monotonic() - start
            if elapsed >= max_wait_time:
                log.error(
                    "Store startup failed: exceeded max wait time of %ss after %d attempts", max_wait_time, attempt
                )
                return False
            attempt += 1
            log.info("Attempting to start store service (attempt %d, elapsed: %.1fs/%ss)", attempt, elapsed, max_wait_time)
            try:
                store = MooncakeDistributedStore()
                if store.setup(self._setup_settings()) == 0:
                    self.store = store
                    if shutdown_event is not None and shutdown_event.is_set():
                        continue  # closes it at the top of the loop
                    log.info("Store service started successfully on %s", self.config.local_hostname)
                    return True
                reason = "Store initialization failed"
            except Exception as error:  # noqa: BLE001 (reported, then retried like upstream)
                reason = str(error)
            remaining = max_wait_time - (time.monotonic() - start)
            pause = max(0.0, min(1.0, remaining))
            log.warning(
                "Store startup failed (attempt %d): %s. Retrying in %.1fs... (remaining time: %.1fs)",
                attempt,
                reason,
                pause,
                remaining,
            )
            if shutdown_event is not None:
                shutdown_event.wait(pause)
            else:
                time.sleep(pause)

    def start_http_service(self, port=8080, host="0.0.0.0"):
        """Serves the REST routes on ``host:port`` from a background thread (``OSError``
        when it cannot bind); returns the port bound."""
        self._http = _http.serve_in_thread(self, host, port)
        bound = self._http.server_address[1]
        log.info("REST API started on port %s", bound)
        return bound

    def stop(self):
        """Stops serving and closes the store (idempotent)."""
        if self._http is not None:
            _http.stop(self._http)
            self._http = None
        if self.store is not None:
            ret = self.store.close()
            self.store = None
            if ret != 0:
                log.warning("Mooncake service close returned %s", ret)
            else:
                log.info("Mooncake service stopped")

    # ----- dispatch -----

    def handle(self, method, path, query, read_body):
        """Answers one request: ``(status, content_type, body)``."""
        route = self._routes.get(path)
        key = None
        if route is None:
            parts = path.split("/")
            if len(parts) == 4 and parts[:2] == ["", "api"] and parts[2] in self._key_routes and parts[3]:
                route = self._key_routes[parts[2]]
                key = urllib.parse.unquote(parts[3])
        if route is None:
            return 404, "text/plain; charset=utf-8", b"404: Not Found"
        allowed, operation, handler = route
        if method != allowed:
            return 405, "text/plain; charset=utf-8", b"405: Method Not Allowed"
        started = time.perf_counter()
        try:
            if key is not None:
                return handler(key)
            return handler(read_body)
        except (_http.BodyTooLarge, _http.BadBody):
            raise
        except _Unsupported as unsupported:
            return _error(
                501,
                f"{unsupported} is not supported by mooncake-rs: a node contributes exactly its "
                "global segment (--global_segment_size) and keeps its SSD tier until it restarts",
            )
        except Exception as error:  # noqa: BLE001 (upstream answers every failure with 500)
            log.error("%s error: %s", operation, error)
            return _error(500, str(error))
        finally:
            log.info("%s operation completed in %.2f ms", operation, (time.perf_counter() - started) * 1000)

    def _store_method(self, name):
        """The store's method ``name``, wrapped so that a store without it, or one that
        answers ``NOT_SUPPORTED``, makes the request answer 501. Results come back as
        upstream's: a code, or a dict with the code under ``"ret"``."""
        method = getattr(self.store, name, None)
        if method is None:
            raise _Unsupported(name)

        def call(*args):
            result = method(*args)
            if isinstance(result, dict):
                result = dict(result)
                result.setdefault("ret", result.get("code"))
                code = result["ret"]
            else:
                code = result
            if code == _not_supported_code():
                raise _Unsupported(name)
            return result

        return call

    # ----- key-value routes -----

    def handle_put(self, read_body):
        data = json.loads(read_body())
        key = data.get("key")
        value = data.get("value")
        if not key or value is None:
            return _error(400, "Missing key or value")
        if self.store.put(key, value.encode()) != 0:
            return _error(500, "PUT operation failed")
        return _answer(200, {"status": "success"})

    def handle_get(self, key):
        exists = self.store.is_exist(key)
        if exists == 0:
            return _error(404, "Key not found")
        if exists < 0:
            return _error(500, "Exist check failed")
        value = self.store.get(key)
        if value is None:
            return _error(500, "GET operation failed")
        if value == b"":
            # An empty answer is also what a key removed meanwhile gives.
            exists = self.store.is_exist(key)
            if exists == 0:
                return _error(404, "Key not found")
            if exists < 0:
                return _error(500, "Exist check failed")
        return 200, "application/octet-stream", bytes(value)

    def handle_exist(self, key):
        exists = self.store.is_exist(key)
        if exists < 0:
            return _error(500, "Exist check failed")
        return _answer(200, {"exists": exists > 0})

    def handle_remove(self, key):
        if self.store.remove(key) != 0:
            return _error(500, "Remove operation failed")
        return _answer(200, {"status": "success"})

    def handle_remove_all(self, read_body):
        removed = self.store.remove_all()
        if removed < 0:
            return _error(500, "RemoveAll operation failed")
        return _answer(200, {"status": f"success removed {removed} keys"})

    # ----- segment routes -----

    def handle_reconfigure(self, read_body):
        data = json.loads(read_body())
        mode = data.get("mode", "").lower()
        if mode == "decode":
            return self._reconfigure_decode(data)
        if mode == "prefill":
            with self._state_lock:
                if self.mounted_segment_ids:
                    ret = self._store_method("unmount_segment")(self.mounted_segment_ids)
                    if ret != 0:
                        return _error(500, f"Unmount failed, ret={ret}")
                    self.mounted_segment_ids.clear()
                self.current_mode = "prefill"
                self.last_mount_info.clear()
            return _answer(200, {"status": "success", "mode": self.current_mode})
        return _error(400, "Invalid mode. Use 'decode' or 'prefill'")

    def _reconfigure_decode(self, data):
        path = data.get("path")
        size = data.get("size")
        offset = data.get("offset", 0)
        protocol = data.get("protocol", self.config.protocol)
        location = data.get("location", "")
        if not path or size is None:
            return _error(400, "Missing path or size for decode mode")
        mount = self._store_method("mount_segment")
        unmount = self._store_method("unmount_segment")
        with self._state_lock:
            # Make before break: the new segment is mounted first, the previous ones
            # are retired only once it serves.
            previous = list(self.mounted_segment_ids)
            result = mount(path, size, offset, protocol, location)
            if result["ret"] != 0:
                if previous:
                    log.warning("Reconfigure decode: mount of %s failed (ret=%s); keeping previous segments", path, result["ret"])
                    return _error(
                        500,
                        f"Mount failed, ret={result['ret']}; keeping previous decode segments",
                        mode=self.current_mode,
                    )
                self.current_mode = "prefill"
                self.mounted_segment_ids.clear()
                self.last_mount_info.clear()
                return _error(500, f"Mount failed, ret={result['ret']}; rolled back to prefill", mode=self.current_mode)
            # One at a time, so that only the ids whose unmount failed stay tracked.
            failed = [sid for sid in previous if unmount([sid]) != 0]
            if failed:
                log.warning("Reconfigure decode: unmount of previous segments %s failed; keeping them tracked", failed)
            self.mounted_segment_ids = list(result["segment_ids"]) + failed
            self.current_mode = "decode"
            self.last_mount_info = {
                "path": path,
                "offset": offset,
                "size": size,
                "protocol": protocol,
                "location": location,
            }
            return _answer(
                200, {"status": "success", "mode": self.current_mode, "segment_ids": self.mounted_segment_ids}
            )

    def handle_mount_shm(self, read_body):
        data = json.loads(read_body())
        path = _shm_name_to_path(data.get("name"))
        offset = data.get("offset", 0)
        size = data.get("size")
        protocol = data.get("protocol", self.config.protocol)
        location = data.get("location", "")
        if not path or size is None:
            return _error(400, "Missing or invalid name or size")
        result = self._store_method("mount_segment")(path, size, offset, protocol, location)
        if result["ret"] != 0:
            return _error(500, f"Mount failed, ret={result['ret']}")
        return _answer(200, {"status": "success", "segment_ids": list(result["segment_ids"])})

    def handle_unmount_shm(self, read_body):
        data = json.loads(read_body())
        segment_ids = _segment_ids(data)
        if not segment_ids:
            return _error(400, "Missing segment_ids")
        grace = data.get("grace_period_seconds", 0)
        unmount = self._store_method("unmount_segment")
        failed = []
        with self._state_lock:
            for sid in segment_ids:
                if unmount([sid], grace) != 0:
                    failed.append(sid)
                elif sid in self.mounted_segment_ids:
                    self.mounted_segment_ids.remove(sid)
            if not self.mounted_segment_ids:
                self.current_mode = "prefill"
        if failed:
            return _error(500, "Unmount failed for one or more segments", failed_segment_ids=failed)
        return _answer(200, {"status": "success"})

    def handle_mount(self, read_body):
        data = json.loads(read_body())
        size = data.get("size")
        protocol = data.get("protocol", self.config.protocol)
        location = data.get("location", "")
        if type(size) is not int or size <= 0:
            return _error(400, "Invalid size, must be a positive integer")
        result = self._store_method("allocate_and_mount_segment")(size, protocol, location)
        if result["ret"] != 0:
            return _error(500, f"Allocate and mount failed, ret={result['ret']}")
        return _answer(
            200,
            {
                "status": "success",
                "segment_ids": list(result["segment_ids"]),
                "allocated_size": result["allocated_size"],
            },
        )

    def handle_unmount(self, read_body):
        data = json.loads(read_body())
        segment_ids = _segment_ids(data)
        if not segment_ids:
            return _error(400, "Missing segment_ids")
        grace = data.get("grace_period_seconds", 0)
        ret = self._store_method("unmount_and_free_segment")(segment_ids, grace)
        if ret != 0:
            return _error(500, f"Unmount and free failed, ret={ret}")
        return _answer(200, {"status": "success"})

    def handle_unmount_local_disk(self, read_body):
        try:
            data = json.loads(read_body())
        except ValueError:
            return _error(400, "Malformed JSON body")
        if not isinstance(data, dict):
            return _error(400, "Request body must be a JSON object")
        grace = data.get("grace_period_seconds", 0)
        if type(grace) is not int or not 0 <= grace <= _MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS:
            return _error(
                400,
                "Invalid grace_period_seconds, must be a non-negative integer no greater than "
                f"{_MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS}",
            )
        ret = self._store_method("unmount_local_disk_segment")(grace)
        if ret != 0:
            return _error(500, f"Unmount local disk failed, ret={ret}")
        return _answer(200, {"status": "success"})


def _segment_ids(data):
    ids = data.get("segment_ids", [])
    return [ids] if isinstance(ids, str) else ids


def parse_arguments(argv=None):
    """Upstream's flags (``--config``, ``-D``, ``--port``, ``--max-wait-time``) and
    ``--host``."""
    parser = argparse.ArgumentParser(description="Mooncake Store Service with REST API")
    parser.add_argument("--config", type=str, help="Path to Mooncake config file", required=False)
    parser.add_argument(
        "-D",
        "--define",
        action="append",
        default=[],
        help="Override configuration with key=value pairs (e.g., -Dlocal_hostname=example.com)",
    )
    parser.add_argument("--port", type=int, default=8080, help="HTTP API port (default: 8080)")
    parser.add_argument(
        "--host", type=str, default="0.0.0.0", help="HTTP API address (default: 0.0.0.0, every interface)"
    )
    parser.add_argument(
        "--max-wait-time",
        type=float,
        default=60,
        help="Maximum total wait time in seconds (default: 60)",
    )
    return parser.parse_args(argv)


def main(argv=None):
    """Runs the service until SIGINT or SIGTERM; returns the exit status (1 when the
    configuration, the store or the HTTP port fails)."""
    args = parse_arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    overrides = {}
    for item in args.define:
        key, sep, value = item.partition("=")
        if sep:
            overrides[key] = value
        else:
            log.warning("Ignoring invalid CLI config: %s", item)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _frame: (log.info("Received signal %s, shutting down", signum), stop.set()))
    try:
        service = MooncakeStoreService(args.config, overrides)
    except (OSError, ValueError) as error:
        log.error("Configuration load failed: %s", error)
        return 1
    try:
        if not service.start_store_service(max_wait_time=args.max_wait_time, shutdown_event=stop):
            return 0 if stop.is_set() else 1
        try:
            service.start_http_service(args.port, args.host)
        except OSError as error:
            log.error("cannot serve the REST API on %s:%s: %s", args.host, args.port, error)
            return 1
        log.info("Mooncake Store Service is running")
        while not stop.wait(1.0):
            pass
        return 0
    finally:
        service.stop()


def sync_main():
    """Entry point of the ``mc_store_rest_server`` console script."""
    return main()


if __name__ == "__main__":
    sys.exit(sync_main())
