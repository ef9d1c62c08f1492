"""The upstream contract: every attribute of verl, megatron-core, mbridge, transformers or torch that this project
patches, overrides in a subclass, assigns, or reads although it is private, with the versions tested and a fingerprint
of what it was written against.

A renamed method fails loudly; a changed signature or behaviour fails silently (an override that verl stops calling,
a patch that wraps a function with new arguments). So each use below is checked where it is applied, in the process
that applies it (`require`): an attribute that is gone, or whose fingerprint differs from the one recorded here,
refuses in one line naming the package, its installed version and the attribute. ``VCPO_UPSTREAM_UNCHECKED=1`` runs
anyway and logs that line. A version not tested whose touched attributes all match runs, with one warning.
``tests/test_upstream.py`` walks ``vcpo/`` and fails on a touch not listed here, and checks every fingerprint
against the installed packages (its failure prints the installed fingerprint, for updating a row once the new
version is tested).

A fingerprint is the SHA-256 (first 16 hex digits) of a function's, property's or class's source, or a builtin's type.
A touch recorded without one (a module global, a class or instance field, a property read as data) must only exist.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import logging
import os
import textwrap
from dataclasses import dataclass

logger = logging.getLogger(__name__)

UNCHECKED_ENV = "VCPO_UPSTREAM_UNCHECKED"
# the distribution of each upstream top-level module, and the versions this contract was written and tested against
DISTRIBUTIONS = {"verl": "verl", "megatron": "megatron-core", "mbridge": "mbridge", "transformers": "transformers", "torch": "torch"}
TESTED = {"verl": ("0.9.1",), "megatron-core": ("0.16.1",), "mbridge": ("0.15.1",), "transformers": ("5.10.4",),
          "torch": ("2.13.0",)}
# an attribute only its class's methods create (``self.name = ...``): it exists, with no fingerprint of its own
INSTANCE_FIELD = object()


@dataclass(frozen=True)
class Touch:
    """One upstream attribute: ``module:Qualified.name``, how the project touches it (patched: replaced; overridden: by
    a subclass's method; assigned: a field set on an upstream object; read: private, read or mutated; mirrored: its
    behaviour reproduced, not called) and its fingerprint (None: it must only exist)."""

    attribute: str
    how: str
    fingerprint: str | None = None

    @property
    def distribution(self) -> str:
        return DISTRIBUTIONS[self.attribute.split(".", 1)[0].split(":", 1)[0]]


@dataclass(frozen=True)
class Use:
    """What the project does with a set of touches, checked together where it is applied."""

    where: str
    touches: tuple[Touch, ...]


_FSDP = "verl.workers.engine.fsdp.transformer_impl"
_MEGATRON_ENGINE = "verl.workers.engine.megatron.transformer_impl"
_RANDOM = "megatron.core.tensor_parallel.random"
_OPTIMIZER = "megatron.core.optimizer"
_MODEL_TYPE = Touch("verl.workers.config.model:HFModelConfig.model_type", "assigned")
_ENGINE_REGISTRY = Touch("verl.workers.engine.base:EngineRegistry._engines", "read")

USES = {
    "fsdp_engine": Use("vcpo.verl_plugin.engine.fsdp at import: the vcpo FSDP engine's overrides (FSDP2's gradient sync "
                       "stays off through an OPOB step only while verl's step calls _gradient_sync_context)", (
        Touch(f"{_FSDP}:FSDPEngineWithLMHead._gradient_sync_context", "overridden", "182af981f2d364db"),
        Touch(f"{_FSDP}:FSDPEngineWithLMHead.forward_step", "overridden", "35c9ddd611db7d0e"),
        _MODEL_TYPE,
        Touch("transformers.configuration_utils:PreTrainedConfig._attn_implementation", "read"),
    )),
    "megatron_engine": Use("vcpo.verl_plugin.engine.megatron at import: the vcpo Megatron engine's overrides, and the "
                           "finalize hook its OPOB step wraps", (
        Touch(f"{_MEGATRON_ENGINE}:MegatronEngineWithLMHead.forward_step", "overridden", "6e13891d7bd8e4ae"),
        Touch("megatron.core.transformer.transformer_config:TransformerConfig.finalize_model_grads_func", "assigned"),
        _MODEL_TYPE,
    )),
    "megatron_local_layers": Use("vcpo.verl_plugin.engine.layer_spec.honour_transformer_impl, when a Megatron engine is "
                                 "built: mbridge's layer spec and weight names, megatron's local attention's mask", (
        Touch("mbridge.core.llm_bridge:LLMBridge._get_transformer_layer_spec", "patched", "c3e649e136b70901"),
        Touch("mbridge.core.bridge:Bridge._weight_name_mapping_mcore_to_hf", "patched", "22f97623b5b2ca98"),
        Touch("megatron.core.transformer.dot_product_attention:DotProductAttention.forward", "patched", "9965ba02d5a3a317"),
        Touch("megatron.core.transformer.transformer_block:TransformerBlockSubmodules.layer_norm", "assigned"),
    )),
    "megatron_on_cpu": Use("vcpo.verl_plugin.cpu.megatron.enable_megatron_on_cpu, when a Megatron engine is built on the "
                           "CPU platform: megatron's CUDA assumptions answered on the host", (
        Touch("torch.cuda:current_device", "patched", "6e9804168a5c7f8c"),
        Touch("torch.cuda:synchronize", "patched", "7055e6143ffee8f1"),
        Touch("torch:Tensor.cuda", "patched", "method_descriptor"),
        Touch("torch:Tensor.type", "patched", "method_descriptor"),
        Touch(f"{_OPTIMIZER}.optimizer:torch", "patched"),
        Touch(f"{_OPTIMIZER}.clip_grads:torch", "patched"),
        Touch("megatron.core.utils:torch", "patched"),
        Touch("megatron.core.pipeline_parallel.schedules:torch", "patched"),
        Touch(f"{_OPTIMIZER}.optimizer:Float16OptimizerWithFloat16Params.__init__", "patched", "fe98719f827f4f1e"),
        Touch(f"{_OPTIMIZER}.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups", "patched", "2d18fa9c2819f73b"),
        Touch(f"{_OPTIMIZER}.clip_grads:clip_grad_by_total_norm_fp32", "patched", "8edb9da5365045a5"),
        Touch(f"{_OPTIMIZER}.optimizer:clip_grad_by_total_norm_fp32", "patched", "8edb9da5365045a5"),
        Touch(f"{_RANDOM}:CudaRNGStatesTracker", "patched", "0194c15fce9418b7"),
        Touch(f"{_RANDOM}:CudaRNGStatesTracker._is_initialized", "assigned"),
        Touch(f"{_RANDOM}:_MODEL_PARALLEL_RNG_TRACKER_NAME", "read"),
        Touch(f"{_RANDOM}:_CUDA_RNG_STATE_TRACKER", "read"),
        Touch(f"{_RANDOM}:_get_cuda_rng_state", "patched", "aa26caaa069c5c4f"),
        Touch(f"{_RANDOM}:_set_cuda_rng_state", "patched", "b179c9d95438b61c"),
    )),
    "megatron_construction_on_cpu": Use("vcpo.verl_plugin.cpu.megatron.install, at the CPU plugin's import: a Megatron "
                                        "engine's construction on the CPU platform applies megatron_on_cpu first", (
        Touch(f"{_MEGATRON_ENGINE}:MegatronEngine.__init__", "patched", "dde56a36b872089e"),
    )),
    "cpu_engine_registry": Use("vcpo.verl_plugin.cpu.training and .megatron, at the CPU plugin's import: verl's engines "
                               "registered for the cpu device", (_ENGINE_REGISTRY,)),
    "cpu_rollout": Use("vcpo.verl_plugin.cpu.rollout at import: the hf rollout in verl's rollout registry, and the server "
                       "its replica hands verl", (
        Touch("verl.workers.rollout.base:_ROLLOUT_REGISTRY", "read"),
        Touch("verl.workers.rollout.replica:RolloutReplica._server_handle", "assigned"),
        Touch("verl.workers.rollout.replica:RolloutReplica._server_address", "assigned"),
    )),
    "standalone_engines": Use("vcpo.verl_plugin.cpu.standalone at import: verl's model config set as verl's workers set "
                              "it, a random model saved with SDPA attention", (
        _MODEL_TYPE,
        Touch("verl.workers.config.model:HFModelConfig.tokenizer", "assigned"),
        Touch("transformers.configuration_utils:PreTrainedConfig._attn_implementation", "assigned"),
    )),
    "tool_parsers": Use("vcpo.evaluation's command line: the tool-call formats verl registers", (
        Touch("verl.experimental.agent_loop.tool_parser:ToolParser._registry", "read"),
    )),
    "tool_use_evaluation": Use("vcpo.evaluation.tool_use.ToolAgentGenerator: a tool dialogue evaluated as verl's tool "
                               "agent loop trains it (its cut of a tool answer, its assistant message)", (
        Touch("verl.experimental.agent_loop.tool_agent_loop:ToolAgentLoop._call_tool", "mirrored", "571416855e761675"),
        Touch("verl.experimental.agent_loop.tool_agent_loop:ToolAgentLoop._build_assistant_message", "mirrored",
              "4096766ec139adf8"),
    )),
    "per_sequence_gradients": Use("vcpo.core.per_sequence_grads.gradients at import: the combination's in-place list "
                                  "arithmetic, and the gradients it writes", (
        Touch("torch:_foreach_mul_", "read", "builtin_function_or_method"),
        Touch("torch:_foreach_add_", "read", "builtin_function_or_method"),
        Touch("torch:Tensor.grad", "assigned"),
    )),
}

_installed_fingerprints: dict[str, str | None] = {}
_required: set[str] = set()
_warned: set[str] = set()


class UpstreamMismatch(RuntimeError):
    """An upstream attribute the project touches is gone or changed: one line naming package, version, attribute."""


def installed_version(distribution: str) -> str:
    """The installed version, without a local build tag (torch's ``+cpu``)."""
    return importlib.metadata.version(distribution).split("+", 1)[0]


def _assigned_on_self(cls: type, name: str) -> bool:
    """Whether a method of ``cls`` or of a class it inherits from assigns ``self.<name>``."""
    for klass in inspect.getmro(cls):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == name
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                return True
    return False


def resolve(attribute: str):
    """The object at ``module:Qualified.name`` as its owner holds it (a property, classmethod or staticmethod
    undecorated), `INSTANCE_FIELD` for an attribute only the class's methods create; AttributeError where it is gone."""
    module, _, qualified = attribute.partition(":")
    value = importlib.import_module(module)
    for name in qualified.split("."):
        owner = value
        try:
            value = inspect.getattr_static(owner, name)
        except AttributeError:
            dataclass_fields = getattr(owner, "__dataclass_fields__", {})
            if inspect.isclass(owner) and (name in dataclass_fields or _assigned_on_self(owner, name)):
                return INSTANCE_FIELD
            raise
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
    return value


def fingerprint(value) -> str | None:
    """What a touch was written against (module doc): the source's hash, a builtin's type, or None for data."""
    if value is INSTANCE_FIELD:
        return None
    value = inspect.unwrap(value) if inspect.isfunction(value) else value  # an earlier patch's original
    if inspect.isfunction(value) or inspect.ismethod(value) or inspect.isclass(value):
        try:
            return hashlib.sha256(textwrap.dedent(inspect.getsource(value)).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            pass
    return type(value).__name__ if callable(value) else None


def installed_fingerprint(touch: Touch) -> str | None:
    """The touch's fingerprint in the installed package (AttributeError where it is gone); once per process."""
    if touch.attribute not in _installed_fingerprints:
        _installed_fingerprints[touch.attribute] = fingerprint(resolve(touch.attribute))
    return _installed_fingerprints[touch.attribute]


def mismatch(use: str, touch: Touch) -> str | None:
    """One line saying how the installed package breaks ``touch`` (None: it holds)."""
    distribution = touch.distribution
    version, tested = installed_version(distribution), "/".join(TESTED[distribution])
    try:
        found = installed_fingerprint(touch)
    except (AttributeError, ImportError):
        problem = "is gone"
    else:
        if touch.fingerprint in (None, found):
            return None
        problem = f"changed (fingerprint {found}, written against {touch.fingerprint})"
    return (f"{distribution} {version}: {touch.attribute} ({touch.how} by {use}) {problem} since {distribution} {tested}; "
            f"install {distribution}=={TESTED[distribution][-1]}, or set {UNCHECKED_ENV}=1 to run anyway")


def require(use: str) -> None:
    """Check every touch of ``use`` against the installed packages (module doc), once per process: raise
    `UpstreamMismatch` on the first that does not hold, unless ``VCPO_UPSTREAM_UNCHECKED`` is set, which logs it."""
    if use in _required:
        return
    for touch in USES[use].touches:
        problem = mismatch(use, touch)
        if problem is None:
            _warn_untested(touch.distribution)
        elif os.environ.get(UNCHECKED_ENV):
            logger.warning("%s unchecked: %s", UNCHECKED_ENV, problem)
        else:
            raise UpstreamMismatch(problem)
    _required.add(use)


def _warn_untested(distribution: str) -> None:
    version = installed_version(distribution)
    if version not in TESTED[distribution] and distribution not in _warned:
        _warned.add(distribution)
        logger.warning("%s %s is untested (tested: %s); the attributes this project touches match", distribution, version,
                       ", ".join(TESTED[distribution]))


__all__ = ["DISTRIBUTIONS", "TESTED", "UNCHECKED_ENV", "USES", "Touch", "UpstreamMismatch", "Use", "fingerprint", "require",
           "resolve"]
