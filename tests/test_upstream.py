"""The upstream contract (vcpo.upstream): every touch of an upstream package's internals in vcpo/ is listed, every use is
checked somewhere, every fingerprint holds on the installed packages, a mismatch refuses in one line naming package,
version and attribute (or runs, logged, when told to), and megatron's patches are applied only where a Megatron engine
is built, not by importing the engine package every FSDP worker imports."""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vcpo import upstream
from vcpo.upstream import DISTRIBUTIONS, USES, Touch, UpstreamMismatch, Use

ROOT = Path(__file__).resolve().parents[1]


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@dataclass
class ClassFound:
    """A class of vcpo/ with its bases (upstream: dotted; project: dotted vcpo names), its underscored methods and the
    ``self._name`` attributes its body uses."""

    where: str
    upstream_bases: list[str]
    project_bases: list[str]
    names: set[str] = field(default_factory=set)


class UpstreamTouches(ast.NodeVisitor):
    """What one file of vcpo/ does to upstream objects. An upstream object, per scope: a name bound by an import from an
    upstream package, an attribute of one, an instance of an upstream class (a name or parameter annotated with it, or
    bound to a call of a capitalised upstream name), or a loop variable over a tuple of them. Found: an assignment
    (or setattr, delattr) to an attribute of one, a read of its private attribute (``x._name``, ``getattr(x, "_name")``),
    and each class's bases and private names (overrides, resolved by the test). A name bound to any other call's result
    is not followed."""

    def __init__(self, module: str, path: Path):
        self.module, self.path = module, path
        self.scopes: list[dict[str, str]] = [{}]
        self.touches: list[tuple[str, str, str]] = []  # (owner's dotted origin, attribute, file:line)
        self.classes: dict[str, ClassFound] = {}
        self.class_stack: list[ClassFound] = []

    # -- origins -----------------------------------------------------------------------------------
    def bound(self, name: str) -> str | None:
        return self.scopes[-1].get(name)

    def origin(self, node) -> str | None:
        if isinstance(node, ast.Name):
            return self.bound(node.id)
        if isinstance(node, ast.Attribute):
            base = self.origin(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            callee = self.origin(node.func)
            return callee if callee and callee.rsplit(".", 1)[-1][:1].isupper() else None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
            try:
                return self.origin(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return None
        return None

    def upstream_origin(self, node) -> str | None:
        found = self.origin(node)
        return found if found and found.split(".", 1)[0] in DISTRIBUTIONS else None

    def bind(self, name: str, dotted: str | None) -> None:
        if dotted:
            self.scopes[-1][name] = dotted
        else:
            self.scopes[-1].pop(name, None)

    def where(self, node) -> str:
        return f"{self.path.relative_to(ROOT)}:{node.lineno}"

    # -- bindings ----------------------------------------------------------------------------------
    def visit_Import(self, node):
        for alias in node.names:
            self.bind(alias.asname or alias.name.split(".", 1)[0], alias.name if alias.asname else alias.name.split(".", 1)[0])

    def visit_ImportFrom(self, node):
        if node.level == 0 and node.module:
            for alias in node.names:
                self.bind(alias.asname or alias.name, f"{node.module}.{alias.name}")

    def visit_FunctionDef(self, node):
        for decorator in node.decorator_list:
            self.visit(decorator)
        if self.class_stack and private(node.name):
            self.class_stack[-1].names.add(node.name)
        self.scopes.append(dict(self.scopes[-1]))
        arguments = node.args
        for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            self.bind(argument.arg, self.origin(argument.annotation) if argument.annotation else None)
        for statement in node.body:
            self.visit(statement)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        upstream_bases, project_bases = [], []
        for base in node.bases:
            self.visit(base)
            dotted = self.origin(base)
            if dotted and dotted.split(".", 1)[0] in DISTRIBUTIONS:
                upstream_bases.append(dotted)
            elif isinstance(base, ast.Name):
                project_bases.append(self.project_name(base.id))
        found = ClassFound(self.where(node), upstream_bases, project_bases)
        self.classes[f"{self.module}.{node.name}"] = found
        self.bind(node.name, None)  # a class of this file is no upstream object, whatever its bases
        self.class_stack.append(found)
        for statement in node.body:
            self.visit(statement)
        self.class_stack.pop()

    def project_name(self, name: str) -> str:
        """A base class named in this file: imported from a vcpo module, or defined here."""
        for statement in ast.walk(self.tree):
            if isinstance(statement, ast.ImportFrom) and statement.module and statement.module.startswith("vcpo"):
                for alias in statement.names:
                    if (alias.asname or alias.name) == name:
                        return f"{statement.module}.{alias.name}"
        return f"{self.module}.{name}"

    def visit_Assign(self, node):
        self.visit(node.value)
        for target in node.targets:
            self.assigned(target, node)
            if isinstance(target, ast.Name):
                self.bind(target.id, self.origin(node.value))

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.annotation)
        self.assigned(node.target, node)
        if isinstance(node.target, ast.Name):
            self.bind(node.target.id, self.origin(node.annotation))

    def visit_AugAssign(self, node):
        self.visit(node.value)
        self.assigned(node.target, node)

    def visit_For(self, node):
        self.visit(node.iter)
        origins = [self.upstream_origin(element) for element in getattr(node.iter, "elts", [])]
        if isinstance(node.target, ast.Name) and origins and all(origins):
            for dotted in origins:  # the body once per element
                self.bind(node.target.id, dotted)
                for statement in node.body:
                    self.visit(statement)
            self.bind(node.target.id, None)
        else:
            self.assigned(node.target, node)
            for statement in node.body:
                self.visit(statement)
        for statement in node.orelse:
            self.visit(statement)

    # -- touches -----------------------------------------------------------------------------------
    def assigned(self, target, node) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.assigned(element, node)
        elif isinstance(target, ast.Attribute):
            self.visit(target.value)
            owner = self.upstream_origin(target.value)
            if owner:
                self.touches.append((owner, target.attr, self.where(node)))
            self.self_attribute(target)
        elif isinstance(target, ast.Name) and isinstance(node, ast.For):
            self.bind(target.id, None)
        else:
            self.visit(target)

    def self_attribute(self, node: ast.Attribute) -> None:
        if self.class_stack and isinstance(node.value, ast.Name) and node.value.id == "self" and private(node.attr):
            self.class_stack[-1].names.add(node.attr)

    def visit_Attribute(self, node):
        self.visit(node.value)
        self.self_attribute(node)
        owner = self.upstream_origin(node.value)
        if owner and private(node.attr):
            self.touches.append((owner, node.attr, self.where(node)))

    def visit_Call(self, node):
        self.generic_visit(node)
        if not (isinstance(node.func, ast.Name) and len(node.args) >= 2):
            return
        name = node.args[1]
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            return
        owner = self.upstream_origin(node.args[0])
        if owner and (node.func.id in ("setattr", "delattr") or (node.func.id in ("getattr", "hasattr") and private(name.value))):
            self.touches.append((owner, name.value, self.where(node)))

    def walk(self) -> UpstreamTouches:
        self.tree = ast.parse(self.path.read_text())
        self.visit(self.tree)
        return self


def walk_vcpo() -> list[UpstreamTouches]:
    files = sorted((ROOT / "vcpo").rglob("*.py"))
    return [UpstreamTouches(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"), p).walk() for p in files]


def upstream_object(dotted: str):
    """The module or class at a dotted upstream name (its longest importable module, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            value = getattr(value, name)
        return value
    raise ImportError(dotted)


def key(owner, name: str) -> str:
    """A touch as `vcpo.upstream.Touch.attribute` names it: ``module:name`` or ``module:Class.name``."""
    if inspect.ismodule(owner):
        return f"{owner.__name__}:{name}"
    assert inspect.isclass(owner), owner
    return f"{owner.__module__}:{owner.__qualname__}.{name}"


def has(cls: type, name: str) -> bool:
    try:
        inspect.getattr_static(cls, name)
        return True
    except AttributeError:
        return upstream._assigned_on_self(cls, name)


def touched_keys() -> dict[str, str]:
    """Every upstream attribute vcpo/ touches, as the contract names it -> where (the first place)."""
    walks = walk_vcpo()
    found: dict[str, str] = {}
    for walk in walks:
        for owner, name, where in walk.touches:
            found.setdefault(key(upstream_object(owner), name), where)
    classes = {name: found_class for walk in walks for name, found_class in walk.classes.items()}

    def lineage(name: str) -> list[ClassFound]:
        own = classes.get(name)
        return [own, *(c for base in own.project_bases for c in lineage(base))] if own else []

    for name, found_class in classes.items():
        line = lineage(name)
        for base in {b for c in line for b in c.upstream_bases}:
            cls = upstream_object(base)
            for private_name in {n for c in line for n in c.names}:
                if has(cls, private_name):
                    found.setdefault(key(cls, private_name), found_class.where)
    return found


def test_every_upstream_touch_in_vcpo_is_in_the_contract():
    listed = {touch.attribute for use in USES.values() for touch in use.touches}
    found = touched_keys()
    missing = sorted(f"{attribute} ({where})" for attribute, where in found.items() if attribute not in listed)
    assert missing == [], "touched but not in vcpo.upstream.USES: " + "; ".join(missing)
    # what the walk sees, so that a walk that finds nothing cannot pass
    assert {"verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead._gradient_sync_context",
            "megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
            "mbridge.core.llm_bridge:LLMBridge._get_transformer_layer_spec",
            "megatron.core.transformer.transformer_config:TransformerConfig.finalize_model_grads_func",
            "verl.workers.config.model:HFModelConfig.model_type", "torch:Tensor.cuda",
            "verl.workers.rollout.replica:RolloutReplica._server_handle"} <= set(found)


def test_the_walk_finds_each_kind_of_touch(tmp_path):
    """Patches through an alias, a loop and setattr; an instance field; a private read; an override; a mixin's private
    attribute; and nothing for the project's own names or a plain call's result."""
    source = '''
import torch
import megatron.core.tensor_parallel.random as rng
from verl.workers.config import HFModelConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

class Mixin:
    def _step_state(self):
        self._is_offload_param = True

class Engine(Mixin, FSDPEngineWithLMHead):
    def _gradient_sync_context(self):
        self._mine = 1

def patch(config: HFModelConfig, value):
    rng._get_cuda_rng_state = value
    for module in (torch, rng):
        module.flag = True
    setattr(torch.Tensor, "cuda", value)
    config.model_type = "x"
    made = torch.zeros(1)
    made.flag = 1
    return rng._CUDA_RNG_STATE_TRACKER
'''
    path = ROOT / "vcpo" / "_walk_example.py"  # the walk names files relative to the repository
    walk = UpstreamTouches("vcpo._walk_example", path)
    walk.path = path
    walk.tree = ast.parse(source)
    walk.visit(walk.tree)
    touches = {key(upstream_object(owner), name) for owner, name, _ in walk.touches}
    assert touches == {"megatron.core.tensor_parallel.random:_get_cuda_rng_state", "torch:flag",
                       "megatron.core.tensor_parallel.random:flag", "torch:Tensor.cuda",
                       "verl.workers.config.model:HFModelConfig.model_type",
                       "megatron.core.tensor_parallel.random:_CUDA_RNG_STATE_TRACKER"}
    engine = walk.classes["vcpo._walk_example.Engine"]
    assert engine.upstream_bases == ["verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"]
    assert engine.project_bases == ["vcpo._walk_example.Mixin"]
    assert engine.names == {"_gradient_sync_context", "_mine"}
    assert walk.classes["vcpo._walk_example.Mixin"].names == {"_step_state", "_is_offload_param"}
    cls = upstream_object(engine.upstream_bases[0])
    assert [has(cls, name) for name in ("_gradient_sync_context", "_mine", "_is_offload_param")] == [True, False, True]


def required_uses() -> set[str]:
    names = set()
    for path in (ROOT / "vcpo").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "require":
                names |= {arg.value for arg in node.args if isinstance(arg, ast.Constant)}
    return names


def test_every_use_is_required_where_it_is_applied():
    assert required_uses() == set(USES)


def test_the_contract_holds_on_the_installed_packages():
    """Every fingerprint against the installed packages, in a fresh process (this one's tests patch some of them)."""
    script = ("from vcpo.verl_contract import select_cpu_platform; select_cpu_platform()\n"
              "from vcpo.upstream import USES, mismatch\n"
              "for name, use in USES.items():\n"
              "    for touch in use.touches:\n"
              "        problem = mismatch(name, touch)\n"
              "        print(problem or 'ok')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [line for line in lines if line != "ok"] == []
    assert len(lines) == sum(len(use.touches) for use in USES.values())


@pytest.fixture
def fresh_contract(monkeypatch):
    """vcpo.upstream as a fresh process has it: nothing required or fingerprinted yet."""
    monkeypatch.setattr(upstream, "_required", set())
    monkeypatch.setattr(upstream, "_installed_fingerprints", {})
    monkeypatch.setattr(upstream, "_warned", set())
    monkeypatch.delenv(upstream.UNCHECKED_ENV, raising=False)


def fake_use(monkeypatch, *touches: Touch) -> None:
    monkeypatch.setitem(USES, "fake_use", Use("a test", touches))


def test_a_changed_attribute_refuses_in_one_line_naming_package_version_and_attribute(monkeypatch, fresh_contract):
    real = upstream.fingerprint(upstream.resolve("torch.cuda:current_device"))
    fake_use(monkeypatch, Touch("torch.cuda:current_device", "patched", real))
    upstream.require("fake_use")  # the recorded fingerprint holds

    monkeypatch.setattr(upstream, "_required", set())
    monkeypatch.setattr(upstream, "installed_version", lambda distribution: "9.9.9")
    fake_use(monkeypatch, Touch("torch.cuda:current_device", "patched", "0123456789abcdef"))
    with pytest.raises(UpstreamMismatch) as refused:
        upstream.require("fake_use")
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("torch 9.9.9: torch.cuda:current_device (patched by fake_use) changed")
    assert f"fingerprint {real}, written against 0123456789abcdef" in line and "since torch 2.13.0" in line
    assert upstream.UNCHECKED_ENV in line


def test_a_missing_attribute_refuses(monkeypatch, fresh_contract):
    fake_use(monkeypatch, Touch("verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead._renamed_hook", "overridden"))
    with pytest.raises(UpstreamMismatch, match=r"^verl 0\.9\.1: .*FSDPEngineWithLMHead\._renamed_hook \(overridden by fake_use\) "
                                               r"is gone since verl 0\.9\.1; install verl==0\.9\.1"):
        upstream.require("fake_use")


def test_the_override_runs_a_mismatch_and_logs_it(monkeypatch, fresh_contract, caplog):
    fake_use(monkeypatch, Touch("torch.cuda:current_device", "patched", "0123456789abcdef"))
    monkeypatch.setenv(upstream.UNCHECKED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=upstream.__name__):
        upstream.require("fake_use")
    assert len(caplog.records) == 1 and "torch.cuda:current_device (patched by fake_use) changed" in caplog.text


def test_an_untested_version_whose_touches_match_runs_with_one_warning(monkeypatch, fresh_contract, caplog):
    real = upstream.fingerprint(upstream.resolve("torch.cuda:current_device"))
    fake_use(monkeypatch, Touch("torch.cuda:current_device", "patched", real), Touch("torch:Tensor.cuda", "patched", "method_descriptor"))
    monkeypatch.setattr(upstream, "installed_version", lambda distribution: "9.9.9")
    with caplog.at_level(logging.WARNING, logger=upstream.__name__):
        upstream.require("fake_use")
    assert [record.getMessage() for record in caplog.records] == [
        "torch 9.9.9 is untested (tested: 2.13.0); the attributes this project touches match"]


def test_fingerprints_see_through_patches_and_descriptors():
    """A patch made with functools.wraps fingerprints as its original; an instance field and a module global have none;
    a property its getter's source."""
    import functools

    def original(x):
        return x

    @functools.wraps(original)
    def patched(x):
        return original(x)

    assert upstream.fingerprint(patched) == upstream.fingerprint(original) != upstream.fingerprint(lambda x: x)
    assert upstream.resolve("megatron.core.tensor_parallel.random:CudaRNGStatesTracker._is_initialized") is upstream.INSTANCE_FIELD
    assert upstream.fingerprint(upstream.resolve("megatron.core.optimizer.clip_grads:torch")) is None
    getter = upstream.resolve("transformers.configuration_utils:PreTrainedConfig._attn_implementation")
    assert inspect.isfunction(getter)


def test_megatron_patches_wait_for_a_megatron_engine():
    """Importing the engine package (what every FSDP worker does) leaves megatron and mbridge unpatched; the Megatron
    engine's construction (here its patching function) patches them."""
    script = """
from vcpo.verl_contract import select_cpu_platform
select_cpu_platform()
import vcpo.verl_plugin.engine
from mbridge.core.bridge import Bridge
from mbridge.core.llm_bridge import LLMBridge
from megatron.core.transformer.dot_product_attention import DotProductAttention
from vcpo.verl_plugin.engine.layer_spec import PATCHED, honour_transformer_impl
patched = lambda: [getattr(f, PATCHED, False) for f in (LLMBridge._get_transformer_layer_spec,
                   Bridge._weight_name_mapping_mcore_to_hf, DotProductAttention.forward)]
print(patched())
honour_transformer_impl()
print(patched())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-3:-1] == ["[False, False, False]", "[True, True, True]"]
