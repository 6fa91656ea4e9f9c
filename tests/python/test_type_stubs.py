"""The type stubs (``mooncake/store.pyi``) list every method of
``MooncakeDistributedStore`` with the parameters the code takes, and every public name
of the module."""

import ast
import inspect
from pathlib import Path

import mooncake.store as store_module
from mooncake.store import MooncakeDistributedStore
from upstream_names import UPSTREAM_MODULE, UPSTREAM_STORE

STUB = Path(store_module.__file__).with_suffix(".pyi")


def _stub_tree():
    return ast.parse(STUB.read_text())


def _stub_methods():
    """{name: [parameter names, without self]} of the stub's MooncakeDistributedStore."""
    (store,) = [n for n in _stub_tree().body if isinstance(n, ast.ClassDef) and n.name == "MooncakeDistributedStore"]
    methods = {}
    for node in store.body:
        if isinstance(node, ast.FunctionDef):
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args][1:]
            if args.vararg:
                names.append("*" + args.vararg.arg)
            names += [a.arg for a in args.kwonlyargs]
            methods[node.name] = names
    return methods


def _runtime_parameters(method):
    names = []
    for p in list(inspect.signature(method).parameters.values())[1:]:
        names.append("*" + p.name if p.kind is inspect.Parameter.VAR_POSITIONAL else p.name)
    return names


def test_stub_lists_every_method_with_the_code_s_parameters():
    stub = _stub_methods()
    public = sorted({n for n in dir(MooncakeDistributedStore) if not n.startswith("_")} | set(UPSTREAM_STORE))
    assert sorted(set(public) - set(stub)) == [], "methods missing from store.pyi"
    assert sorted(set(stub) - set(public) - {"__init__"}) == [], "store.pyi lists methods the class lacks"
    wrong = {}
    for name in public:
        runtime = _runtime_parameters(getattr(MooncakeDistributedStore, name))
        if stub[name] != runtime:
            wrong[name] = (stub[name], runtime)
    assert wrong == {}, "store.pyi parameters != the code's (stub, code)"


def test_stub_declares_every_upstream_module_name():
    declared = set()
    for node in _stub_tree().body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            declared.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            declared.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
        elif isinstance(node, ast.Assign):
            declared.update(t.id for t in node.targets if isinstance(t, ast.Name))
    assert sorted(set(UPSTREAM_MODULE) - declared) == []
