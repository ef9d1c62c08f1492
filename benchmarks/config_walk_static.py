"""The static config walk: from Trainer.__init__(config) then Trainer.run() in vcpo/sim/train.py, every call site
(all branches, in source order, depth first, each function walked once) whose arguments mention the config: a name
bound to it or derived from it (a parameter that received such an argument, ``config.x``, ``self.<attr>`` assigned
from it, a name assigned from it or from a vcpo call that received it). The callee, resolved through imports to a
vcpo function or class, is the room's visit; the walk then goes into it. Calls on the receiver alone (``self``,
``config.recorded()``) do not count.

    python benchmarks/config_walk_static.py ROOT [-v: every call] [-s: each room sequence]   (ROOT: a checkout)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


class Package:
    def __init__(self, root: Path):
        self.trees, self.defs, self.imports = {}, {}, {}
        for path in sorted((root / "vcpo").rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            tree = ast.parse(path.read_text())
            self.trees[name] = tree
            self.defs[name] = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
            imports = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module:
                    base = node.module if not node.level else ".".join(name.split(".")[: -node.level] + (
                        [node.module] if node.module else []))
                    if name in self.trees and path.name == "__init__.py" and node.level:
                        base = ".".join(name.split(".")[: len(name.split(".")) - node.level + 1] + [node.module])
                    for alias in node.names:
                        imports[alias.asname or alias.name] = (base, alias.name)
            self.imports[name] = imports

    def resolve(self, module: str, name: str, depth: int = 0):
        """(module, def node) of ``name`` as ``module`` sees it, or None outside vcpo."""
        if depth > 5:
            return None
        if name in self.defs.get(module, {}):
            return module, self.defs[module][name]
        if name in self.imports.get(module, {}):
            base, member = self.imports[module][name]
            if base.startswith("vcpo"):
                return self.resolve(base, member, depth + 1)
        return None


def names_in(node) -> list[ast.AST]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute)]


class Walker:
    def __init__(self, package: Package):
        self.package = package
        self.calls: list[tuple[str, str]] = []
        self.walked: set[tuple[str, str]] = set()
        self.class_attrs: dict[str, set[str]] = {}  # class -> self attributes holding (derived) config
        self.attr_types: dict[str, dict[str, tuple[str, ast.ClassDef]]] = {}

    def mentions(self, node, tracked: set[str], cls: str | None) -> bool:
        for n in names_in(node):
            if isinstance(n, ast.Name) and n.id in tracked:
                return True
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and cls
                    and n.attr in self.class_attrs.get(cls, set())):
                return True
        return False

    def callee(self, func, module: str, cls_node, tracked):
        if isinstance(func, ast.Name):
            return self.package.resolve(module, func.id)
        if isinstance(func, ast.Attribute):
            value = func.value
            if isinstance(value, ast.Name) and value.id == "self" and cls_node is not None:
                method = next((n for n in cls_node.body if isinstance(n, ast.FunctionDef) and n.name == func.attr), None)
                return (module, method, cls_node) if method else None
            if (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self"
                    and cls_node is not None and value.attr in self.attr_types.get(cls_node.name, {})):
                owner_module, owner = self.attr_types[cls_node.name][value.attr]
                method = next((n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == func.attr), None)
                return (owner_module, method, owner) if method else None
        return None

    def walk(self, module: str, fn: ast.FunctionDef, tracked: set[str], cls_node=None) -> None:
        key = (module, (cls_node.name + "." if cls_node else "") + fn.name)
        if key in self.walked:
            return
        self.walked.add(key)
        cls = cls_node.name if cls_node else None
        for node in self.in_order(fn.body):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                derived = self.mentions(node.value, tracked, cls)
                for target in targets:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Name) and derived:
                            tracked.add(t.id)
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and cls:
                            if derived:
                                self.class_attrs.setdefault(cls, set()).add(t.attr)
                            if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
                                found = self.package.resolve(module, node.value.func.id)
                                if found and isinstance(found[1], ast.ClassDef):
                                    self.attr_types.setdefault(cls, {})[t.attr] = found
            if not isinstance(node, ast.Call):
                continue
            arguments = [*node.args, *(k.value for k in node.keywords)]
            if not any(self.mentions(a, tracked, cls) for a in arguments):
                continue
            found = self.callee(node.func, module, cls_node, tracked)
            if not found:
                continue
            if len(found) == 2:
                target_module, target = found
                owner = None
                if isinstance(target, ast.ClassDef):
                    owner = target
                    target = next((n for n in target.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
                    if target is None:
                        self.calls.append((target_module, owner.name))
                        continue
            else:
                target_module, target, owner = found
            self.calls.append((target_module, (owner.name + "." if owner else "") + target.name))
            params = [a.arg for a in target.args.args]
            if owner is not None:
                params = params[1:]
            bound = set()
            for param, value in zip(params, node.args, strict=False):  # defaults fill the rest
                if self.mentions(value, tracked, cls):
                    bound.add(param)
            for k in node.keywords:
                if k.arg and self.mentions(k.value, tracked, cls):
                    bound.add(k.arg)
            self.walk(target_module, target, bound, owner)

    def in_order(self, body):
        """Every node of ``body`` in source order (a statement's value before its targets' use after it)."""
        out = []

        def visit(node):
            if isinstance(node, ast.Call):
                for child in [node.func, *node.args, *(k.value for k in node.keywords)]:
                    visit(child)
                out.append(node)
                return
            if isinstance(node, ast.Assign | ast.AnnAssign):
                visit(node.value) if node.value is not None else None
                out.append(node)
                return
            for child in ast.iter_child_nodes(node):
                visit(child)

        for statement in body:
            visit(statement)
        return out


def room(module: str, rooms: str) -> str:
    parts = module.split(".")
    if rooms == "module" or (rooms == "sim" and parts[:2] == ["vcpo", "sim"]):
        return module
    return ".".join(parts[:2])


def main(root: str) -> None:
    package = Package(Path(root))
    walker = Walker(package)
    module = "vcpo.sim.train"
    trainer = package.defs[module]["Trainer"]
    method = {n.name: n for n in trainer.body if isinstance(n, ast.FunctionDef)}
    walker.calls.append((module, "Trainer.__init__"))
    walker.walk(module, method["__init__"], {"config"}, trainer)
    walker.walk(module, method["run"], set(), trainer)
    if "-v" in sys.argv:
        for call in walker.calls:
            print("  " + ".".join(call))
    for rooms in ("package", "sim", "module"):
        sequence = []
        for m, _ in walker.calls:
            r = room(m, rooms)
            if not sequence or sequence[-1] != r:
                sequence.append(r)
        returns = sum(1 for i, r in enumerate(sequence) if r in sequence[:i])
        print(f"{rooms:8} {len(sequence)} stays, {len(set(sequence))} rooms, {returns} returns")
        if "-s" in sys.argv:
            print("    " + " -> ".join(r.removeprefix("vcpo.") for r in sequence))


if __name__ == "__main__":
    main(sys.argv[1])
