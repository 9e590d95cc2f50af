""""Nothing a peer sends is unpickled" (README, Security): no module of ``transport`` or ``rl_sync``
imports a deserializer that can run code (pickle and its relatives) or calls one (``torch.load``,
``numpy.load`` with pickles allowed, ``eval``/``exec``). Peers' bytes are decoded by msgspec into
fixed structs (``transport.wire``, ``rl_sync.messages``); ``tests/test_fuzz_wire.py`` feeds them
hostile bytes. This reads the source, so a change that adds such a call fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p for pkg in ("transport", "rl_sync") for p in (ROOT / pkg).rglob("*.py"))
BANNED_IMPORTS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle", "joblib"}
BANNED_CALLS = {("torch", "load"), ("numpy", "load"), ("np", "load"), ("builtins", "eval"), ("builtins", "exec")}


def _findings(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_IMPORTS]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in BANNED_IMPORTS:
            out.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id in ("eval", "exec", "__import__"):
                out.append(f"{fn.id}() at line {node.lineno}")
            elif isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and (fn.value.id, fn.attr) in BANNED_CALLS:
                out.append(f"{fn.value.id}.{fn.attr}() at line {node.lineno}")
    return out


def test_the_packages_have_modules_to_read():
    assert len(MODULES) > 50, MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_can_unpickle_what_a_peer_sends(path):
    assert not _findings(path), f"{path.relative_to(ROOT)}: {_findings(path)}"


def test_the_check_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom marshal import loads\nimport torch\nx = torch.load(f)\neval('1')\n")
    assert len(_findings(bad)) == 4, _findings(bad)
