"""Scale-out on torch.distributed, applied to a built K3 from outside: device mesh, MoonEP expert parallelism,
KDA/MLA context parallelism, FSDP2 for the non-expert parameters, and the `k3 plan` memory planner."""
from k3.parallel.mesh import ParallelDims, ParallelMesh, init_distributed
from k3.parallel.planner import ExpertPlan, plan_balanced, plan_plain

__all__ = ["ParallelDims", "ParallelMesh", "init_distributed", "ExpertPlan", "plan_balanced", "plan_plain"]
