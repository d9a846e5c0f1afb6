"""AgentENV: isolated, resumable sandboxes (bwrap, gvisor, firecracker backends), an E2B-shaped control plane
and partial-rollout agent loops on top of `k3 serve`."""
from k3.agentenv.api import (BackendUnavailable, ExecResult, Limits, Sandbox, SandboxError, SandboxPool, SandboxSpec,
                             SandboxTimeout, Snapshot, available_backends, get_backend)

__all__ = ["BackendUnavailable", "ExecResult", "Limits", "Sandbox", "SandboxError", "SandboxPool", "SandboxSpec",
           "SandboxTimeout", "Snapshot", "available_backends", "get_backend"]
