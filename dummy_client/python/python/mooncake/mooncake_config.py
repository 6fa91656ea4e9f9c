"""Upstream's ``MooncakeConfig``: the settings of a store node, read from a JSON file
(``MooncakeConfig.from_file``) or from the environment (``MooncakeConfig.load_from_env``).

Same names, JSON keys, environment variables, defaults and validation as upstream's
``mooncake.mooncake_config``, so code written for it runs unchanged.

JSON keys (the first three are required and must be non-empty)::

    local_hostname, metadata_server, master_server_address,
    global_segment_size (default 3355443200; "4gb", "512MB", "1.5g" also accepted),
    local_buffer_size (default 1073741824; same forms), protocol ("tcp"),
    device_name (""), enable_ssd_offload (false), ssd_offload_path (""),
    tenant_id ("default"), enable_client_http_server (false), client_http_port (9300)

Environment (when ``MOONCAKE_CONFIG_PATH`` names no file; ``MOONCAKE_MASTER`` is then
required)::

    MOONCAKE_MASTER                      master_server_address
    MOONCAKE_LOCAL_HOSTNAME              local_hostname ("localhost")
    MOONCAKE_TE_META_DATA_SERVER         metadata_server ("P2PHANDSHAKE")
    MOONCAKE_GLOBAL_SEGMENT_SIZE         global_segment_size
    MOONCAKE_LOCAL_BUFFER_SIZE           local_buffer_size
    MOONCAKE_PROTOCOL                    protocol ("tcp")
    MOONCAKE_DEVICE                      device_name ("")
    MOONCAKE_OFFLOAD_ENABLED             enable_ssd_offload ("false")
    MOONCAKE_OFFLOAD_FILE_STORAGE_PATH   ssd_offload_path ("")
    MOONCAKE_TENANT_ID                   tenant_id ("default")
    MOONCAKE_ENABLE_CLIENT_HTTP_SERVER   enable_client_http_server ("false")
    MOONCAKE_CLIENT_HTTP_PORT            client_http_port (9300)

The protocol is lowercased; one that upstream does not know is kept, with a warning
(mooncake-rs itself moves bytes over TCP whatever the protocol says).
"""

import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

#: ``global_segment_size`` when none is given: 3.125 GiB.
DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200
#: ``local_buffer_size`` when none is given: 1 GiB.
DEFAULT_LOCAL_BUFFER_SIZE = 1073741824

# Longest suffixes first, so that "kb" is not read as "b".
_UNITS = (
    ("kb", 1 << 10),
    ("mb", 1 << 20),
    ("gb", 1 << 30),
    ("tb", 1 << 40),
    ("k", 1 << 10),
    ("m", 1 << 20),
    ("g", 1 << 30),
    ("t", 1 << 40),
    ("b", 1),
)

# Protocols upstream's engines know (a hint for the warning, not a gate).
_KNOWN_PROTOCOLS = frozenset(
    "tcp rdma efa nvmeof nvlink musa nvlink_intra hip barex cxl ascend "
    "ub ubshmem maca sunrise_link rpc_only".split()
)

_REQUIRED_FIELDS = ("local_hostname", "metadata_server", "master_server_address")

_TRUE = frozenset(("true", "1", "yes", "on", "enable"))
_FALSE = frozenset(("false", "0", "no", "off", "disable"))


def _parse_segment_size(value) -> int:
    """A size in bytes from an int or a string such as ``"4gb"``, ``"512 MB"``,
    ``"1.5g"`` or ``"4096"`` (binary units); ``ValueError`` when it does not parse."""
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return int(value)
    text = value.strip().lower()
    if not text:
        raise ValueError("Invalid segment size: empty string")
    for suffix, scale in _UNITS:
        if text.endswith(suffix):
            number = text[: -len(suffix)].strip()
            if not number:
                raise ValueError(f"Invalid segment size: missing number before '{suffix}'")
            return int(float(number) * scale)
    return int(float(text))


def _parse_bool(value) -> bool:
    """A boolean from a bool, a number, ``None`` (false) or text such as ``"yes"``,
    ``"off"``, ``"1"`` (empty text is false); ``ValueError`` for other text."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if value is None:
        return False
    text = str(value).strip().lower()
    if not text:
        return False
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"Invalid boolean value: {value!r}")


@dataclass
class MooncakeConfig:
    """Settings of a store node (upstream's fields and defaults; see the module doc).

    ``__post_init__`` lowercases the protocol and rejects an empty protocol, a negative
    size and an empty required field with ``ValueError``.
    """

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: Optional[str]
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300

    def __post_init__(self):
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(
                f"Invalid protocol: {self.protocol!r}. Protocol must be a non-empty "
                "string, e.g. 'tcp' or 'rdma'."
            )
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in _KNOWN_PROTOCOLS:
            logger.warning(
                "Unrecognised protocol %r; passing it through unchanged. Known protocols are: %s.",
                self.protocol,
                ", ".join(sorted(_KNOWN_PROTOCOLS)),
            )
        for name in ("global_segment_size", "local_buffer_size"):
            size = getattr(self, name)
            if size < 0:
                raise ValueError(f"Invalid {name}: {size}. Size must be non-negative.")
        for name in _REQUIRED_FIELDS:
            text = getattr(self, name)
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"Config field {name!r} must be a non-empty string, got {text!r}.")

    @staticmethod
    def from_file(file_path: str) -> "MooncakeConfig":
        """Reads the JSON file at ``file_path`` (``ValueError`` when a required key is
        missing; ``OSError`` or ``json.JSONDecodeError`` when it cannot be read)."""
        with open(file_path) as file:
            data = json.load(file)
        for name in _REQUIRED_FIELDS:
            if name not in data:
                raise ValueError(f"Missing required config field: {name}")
        offload_path = data.get("ssd_offload_path")
        tenant = data.get("tenant_id")
        return MooncakeConfig(
            local_hostname=data.get("local_hostname"),
            metadata_server=data.get("metadata_server"),
            global_segment_size=_parse_segment_size(
                data.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)
            ),
            local_buffer_size=_parse_segment_size(data.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=data.get("protocol", "tcp"),
            device_name=data.get("device_name", ""),
            master_server_address=data.get("master_server_address"),
            enable_ssd_offload=_parse_bool(data.get("enable_ssd_offload", False)),
            ssd_offload_path="" if offload_path is None else str(offload_path),
            tenant_id="default" if tenant is None else str(tenant),
            enable_client_http_server=_parse_bool(data.get("enable_client_http_server", False)),
            client_http_port=int(data.get("client_http_port", 9300)),
        )

    @staticmethod
    def load_from_env() -> "MooncakeConfig":
        """The file named by ``MOONCAKE_CONFIG_PATH`` when set, else the ``MOONCAKE_*``
        variables (``ValueError`` when neither it nor ``MOONCAKE_MASTER`` is set)."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        master = os.getenv("MOONCAKE_MASTER")
        if not master:
            raise ValueError(
                "Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor 'MOONCAKE_MASTER' is set."
            )
        env = os.getenv
        return MooncakeConfig(
            local_hostname=env("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=_parse_segment_size(
                env("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_GLOBAL_SEGMENT_SIZE)
            ),
            local_buffer_size=_parse_segment_size(env("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=env("MOONCAKE_PROTOCOL", "tcp"),
            device_name=env("MOONCAKE_DEVICE", ""),
            master_server_address=master,
            enable_ssd_offload=_parse_bool(env("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=_parse_bool(env("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false")),
            client_http_port=int(env("MOONCAKE_CLIENT_HTTP_PORT", 9300)),
        )
