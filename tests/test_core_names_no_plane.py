"""The core of ``transport`` names no data plane: each plane's protocol lives in ``transport/planes/``.

The endpoint, its connector, the channel and its halves (reader, target, sender, receiver, loop
reads), the op table, the handshake and the registry reach the planes only through the
``transport.planes`` package's face (``PlaneOffers``, ``PlaneChoice``, ``wire_semantics``,
``export_fault``, ``link_refusal``, the ``DataPlane``/``Exporter``/``PeerLink`` interfaces). This
reads their source: no string that is a plane's name, no identifier, attribute, argument or import
named after one (``nccl``, ``ipc``, ``shm``, ``p2p``), and no import of a concrete plane module.
Docstrings and comments may still say what a plane does.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TRANSPORT = Path(__file__).resolve().parents[1] / "transport"
CORE = ["address", "blocking", "channel", "connector", "dispatch", "endpoint", "exports", "handshake", "inbox",
        "loop_reads", "op", "op_table", "operations", "peer", "ranges", "receiver", "registry", "remote", "sender",
        "serving", "transfer"]
PLANE_NAMES = {"shm", "tcp", "cuda_ipc", "nccl"}
NAMED = re.compile(r"nccl|ipc|shm|p2p", re.IGNORECASE)


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _findings(path: Path) -> list[str]:
    """Where the module at ``path`` names a plane (see the module docstring)."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in PLANE_NAMES:
                found.append(f"line {node.lineno}: the string {node.value!r}")
        elif isinstance(node, ast.Name) and NAMED.search(node.id):
            found.append(f"line {node.lineno}: name {node.id}")
        elif isinstance(node, ast.Attribute) and NAMED.search(node.attr):
            found.append(f"line {node.lineno}: attribute .{node.attr}")
        elif isinstance(node, ast.arg) and NAMED.search(node.arg):
            found.append(f"line {node.lineno}: argument {node.arg}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and NAMED.search(node.name):
            found.append(f"line {node.lineno}: definition {node.name}")
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            if "planes" in parts and parts[-1] not in ("planes", "base"):  # (a concrete plane module)
                found.append(f"line {node.lineno}: imports {node.module}")
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if NAMED.search(a.name)]
    return found


@pytest.mark.parametrize("module", CORE)
def test_core_module_names_no_plane(module: str) -> None:
    found = _findings(TRANSPORT / f"{module}.py")
    assert not found, f"transport/{module}.py names a plane:\n" + "\n".join(found)


def test_the_check_sees_a_plane_name(tmp_path: Path) -> None:
    """(The check itself: a core-like module that names planes is caught.)"""
    fake = tmp_path / "fake.py"
    fake.write_text('from .planes.cuda_ipc import IpcThing\n'
                    'def f(nccl_engine):\n    return x.ipc_acks or p == "shm"\n')
    text = "\n".join(_findings(fake))
    for what in ("imports planes.cuda_ipc", "imports IpcThing", "argument nccl_engine", "attribute .ipc_acks",
                 "the string 'shm'"):
        assert what in text, text
