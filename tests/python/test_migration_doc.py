"""docs/migration.md tells the truth: its tables list every public name and flag of
upstream (0.3.13) exactly once, the flags' statuses are the ones the binaries report,
and what the doc calls "same" exists in this package."""

import importlib
import json
import re
import subprocess
from pathlib import Path

import pytest

import mooncake.store as store_module
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from mooncake_testlib import REPO_ROOT, client_binary, master_binary
from upstream_names import (
    UPSTREAM_COMMANDS,
    UPSTREAM_CONFIG,
    UPSTREAM_MODULE,
    UPSTREAM_PACKAGE_MODULES,
    UPSTREAM_STORE,
)

DOC = REPO_ROOT / "docs" / "migration.md"
STATUSES = ("same", "differs", "refused")

# First header cell of each table -> what the table lists.
NAMES, METHODS, FIELDS, MODULES = "name", "method", "field", "module or command"
MASTER_FLAGS, CLIENT_FLAGS = "`mooncake_master` flag", "`mooncake_client` flag"


def _tables():
    """{first header cell: [(name, status word, status text), ...]} of the doc's tables
    with a ``status`` column; a table's name cell is one backquoted name."""
    tables, rows, header = {}, None, None
    for line in DOC.read_text().splitlines() + [""]:
        if not line.startswith("|"):
            if rows is not None:
                tables.setdefault(header, []).extend(rows)
            rows = header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if header is None:
            header = cells[0]
            rows = [] if len(cells) == 2 and cells[1] == "status" else None
            continue
        if rows is None or re.fullmatch(r"\|[-:| ]+\|", line.strip()):
            continue
        name = re.fullmatch(r"`([^`]+)`", cells[0])
        assert name, f"{DOC.name}: the name cell of {line!r} is not one `name`"
        word = re.match(r"[a-z]+", cells[1])
        rows.append((name.group(1), word.group(0) if word else cells[1], cells[1]))
    return tables


TABLES = _tables()


def _rows(table):
    assert table in TABLES, f"{DOC.name} has no table whose first column is {table!r}"
    return TABLES[table]


@pytest.mark.parametrize("table", [NAMES, METHODS, FIELDS, MODULES, MASTER_FLAGS, CLIENT_FLAGS])
def test_every_row_has_a_known_status_and_says_how_or_why(table):
    for name, word, text in _rows(table):
        assert word in STATUSES, f"{name}: status {text!r} is not one of {STATUSES}"
        if word != "same":
            assert text.startswith(word + ": ") and len(text) > len(word) + 8, f"{name}: {word} needs its how/why: {text!r}"


def _exactly_once(rows, expected, what):
    names = [name for name, _, _ in rows]
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert repeated == [], f"{what}: rows listed twice: {repeated}"
    assert sorted(set(expected) - set(names)) == [], f"{what}: upstream names without a row"
    assert sorted(set(names) - set(expected)) == [], f"{what}: rows that are not upstream names"


def test_module_names_have_one_row_each():
    _exactly_once(_rows(NAMES), UPSTREAM_MODULE, "names of mooncake.store")


def test_store_methods_have_one_row_each():
    _exactly_once(_rows(METHODS), UPSTREAM_STORE, "MooncakeDistributedStore methods")


def test_replicate_config_fields_have_one_row_each():
    _exactly_once(_rows(FIELDS), UPSTREAM_CONFIG, "ReplicateConfig fields")


def test_modules_and_commands_have_one_row_each():
    expected = ["mooncake", *(f"mooncake.{m}" for m in UPSTREAM_PACKAGE_MODULES), *UPSTREAM_COMMANDS]
    _exactly_once(_rows(MODULES), expected, "modules and commands")


def test_rows_that_are_not_refused_name_things_that_exist():
    config = ReplicateConfig()
    for name, word, _ in _rows(NAMES):
        if word != "refused":
            assert hasattr(store_module, name), f"mooncake.store.{name} is documented {word} but missing"
    for name, word, _ in _rows(METHODS):
        if word != "refused":
            assert callable(getattr(MooncakeDistributedStore, name, None)), f"{name} is documented {word} but missing"
    for name, word, _ in _rows(FIELDS):
        assert hasattr(config, name), f"ReplicateConfig.{name} is documented {word} but missing"


def _console_scripts():
    text = (REPO_ROOT / "dummy_client" / "python" / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, flags=re.MULTILINE))


def _importable(module):
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def test_modules_and_commands_exist_unless_refused():
    scripts = _console_scripts()
    for name, word, _ in _rows(MODULES):
        exists = _importable(name) if name.startswith("mooncake") and name not in scripts else name in scripts
        if word == "refused":
            assert not exists, f"{name} is documented as not provided, but it exists: update docs/migration.md"
        else:
            assert exists, f"{name} is documented {word} but does not exist"


def _flags(binary):
    if not Path(binary).exists():
        pytest.skip(f"{binary} is not built (cargo build --release)")
    out = subprocess.run([str(binary), "--list_flags_json"], capture_output=True, text=True, timeout=60, check=True)
    return {flag["name"]: flag["status"] for flag in json.loads(out.stdout)}


@pytest.mark.parametrize(("table", "binary"), [(MASTER_FLAGS, master_binary), (CLIENT_FLAGS, client_binary)])
def test_flag_rows_match_the_binary(table, binary):
    upstream = {name: status for name, status in _flags(binary()).items() if status in STATUSES}
    rows = _rows(table)
    for name, _, _ in rows:
        assert name.startswith("--"), f"{table}: {name!r} is not written as --flag"
    documented = {name[2:]: word for name, word, _ in rows}
    _exactly_once([(n[2:], w, t) for n, w, t in rows], upstream, table)
    wrong = {name: (documented[name], status) for name, status in upstream.items() if documented[name] != status}
    assert wrong == {}, f"{table}: documented status != --list_flags_json status (doc, binary)"
