"""Tools the policy calls during multi-turn rollouts.

``run_python`` is the plain sandbox; ``vcpo.tools.python_tool.PythonSandboxTool`` wraps it for verl's
tool agent loop (imported separately, as it pulls in verl).
"""

from vcpo.tools.sandbox import SandboxResult, SandboxStatus, namespaces_available, run_python

__all__ = ["SandboxResult", "SandboxStatus", "namespaces_available", "run_python"]
