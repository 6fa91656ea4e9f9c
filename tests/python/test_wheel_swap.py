"""Installing this wheel over upstream's leaves no silent swap: when upstream's compiled
`store` module is still in the `mooncake` package directory (the two wheels have
different distribution names, so pip reports no conflict), importing the package fails
with an error that names the file and the command that removes it."""

import os
import pathlib
import shutil
import subprocess
import sys

import mooncake


def copy_package(tmp_path):
    """This package, as installed, in a directory of its own on the import path."""
    source = pathlib.Path(mooncake.__file__).parent
    target = tmp_path / "site" / "mooncake"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def import_store(site):
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run(
        [sys.executable, "-c", "import mooncake.store; print(mooncake.store.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_a_leftover_upstream_store_module_is_refused_at_import(tmp_path):
    package = copy_package(tmp_path)
    leftover = package / "store.so"  # upstream's wheel ships it under this name
    leftover.write_bytes(b"\x7fELF not really")
    run = import_store(package.parent)
    assert run.returncode != 0
    assert "ImportError" in run.stderr, run.stderr
    assert str(leftover) in run.stderr, run.stderr
    assert "pip uninstall mooncake-transfer-engine mooncake-transfer-engine-non-cuda" in run.stderr
    assert "--force-reinstall" in run.stderr


def test_a_versioned_extension_name_is_refused_too(tmp_path):
    package = copy_package(tmp_path)
    (package / "store.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    run = import_store(package.parent)
    assert run.returncode != 0 and "store.cpython-311-x86_64-linux-gnu.so" in run.stderr


def test_the_package_alone_imports_its_own_store(tmp_path):
    package = copy_package(tmp_path)
    run = import_store(package.parent)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(package / "store.py")
