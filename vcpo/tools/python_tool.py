"""The Python sandbox as a tool for verl's multi-turn tool agent loop (SimpleTIR setting).

verl instantiates it from a tool config YAML (``recipes/tools/python_sandbox.yaml``) passed as
``actor_rollout_ref.rollout.multi_turn.tool_config_path``. Each call runs the model's code in a fresh
sandbox (``vcpo.tools.sandbox.run_python``); calls are stateless, as the agent loop creates and
releases a tool instance around every call anyway.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

from vcpo.tools.sandbox import SandboxResult, SandboxStatus, run_python

# Keys of the tool's `config` block besides verl's own `type`.
_LIMIT_KEYS = frozenset(
    {
        "timeout_s",
        "cpu_time_s",
        "memory_mb",
        "max_output_bytes",
        "max_file_mb",
        "max_processes",
        "max_open_files",
        "site_packages",
        "isolation",
        "syscall_filter",
        "hide_host_files",
    }
)
_TOOL_KEYS = frozenset({"type", "max_concurrency"})

DEFAULT_TOOL_SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "code_interpreter",
            "description": (
                "Run a Python program in a fresh sandbox and return what it prints. Nothing persists "
                "between calls; print every value you need. numpy and sympy can be imported."
            ),
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The complete Python program."}},
                "required": ["code"],
            },
        },
    }
)

_STATUS_NOTES = {
    SandboxStatus.TIMEOUT: "stopped: wall-clock time limit reached",
    SandboxStatus.OUTPUT_LIMIT: "stopped: output limit reached",
    SandboxStatus.CPU_LIMIT: "stopped: CPU time limit reached",
    SandboxStatus.MEMORY_LIMIT: "stopped: memory limit reached",
    SandboxStatus.KILLED: "stopped by a signal",
}


def format_result(result: SandboxResult) -> str:
    """The text the model sees: stdout, stderr (tracebacks), then why the program was stopped, if it was."""
    sections = []
    if result.stdout:
        sections.append(result.stdout.rstrip("\n"))
    if result.stdout_truncated:
        sections.append("...(output truncated)")
    if result.stderr:
        sections.append(result.stderr.rstrip("\n"))
    if result.status in _STATUS_NOTES:
        sections.append(f"[{_STATUS_NOTES[result.status]}]")
    return "\n".join(sections) if sections else "[no output]"


class PythonSandboxTool(BaseTool):
    """verl ``BaseTool`` that executes a ``code`` argument with ``run_python``.

    Config keys (all optional): the keyword arguments of ``run_python`` (``timeout_s``, ``memory_mb``,
    ...) and ``max_concurrency``, the number of sandboxes this process runs at once (default: CPU count).
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        unknown = set(config) - _LIMIT_KEYS - _TOOL_KEYS
        if unknown:
            raise ValueError(
                f"PythonSandboxTool: unknown config key(s) {sorted(unknown)}; "
                f"allowed: {sorted(_LIMIT_KEYS | _TOOL_KEYS)}"
            )
        super().__init__(config, tool_schema)
        self._limits = {key: value for key, value in config.items() if key in _LIMIT_KEYS}
        self._slots = threading.BoundedSemaphore(int(config.get("max_concurrency") or os.cpu_count() or 1))
        # Fail when verl builds the tool, before any rollout, where the machine cannot confine programs
        # as configured (RuntimeError naming the missing layer and its opt-out).
        run_python("pass", **self._limits)

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or DEFAULT_TOOL_SCHEMA

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="Error: the 'code' argument must be a non-empty string."), 0.0, {}
        result = await asyncio.to_thread(self._run, code)
        metrics = {"status": result.status.value, "wall_time_s": result.wall_time_s}
        return ToolResponse(text=format_result(result)), 0.0, metrics

    def _run(self, code: str) -> SandboxResult:
        with self._slots:
            return run_python(code, **self._limits)
