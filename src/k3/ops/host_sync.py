"""Whether code may read a device value back to the host here: not while a CUDA graph captures (a capture
forbids the sync) nor while torch.compile traces (a read splits the compiled graph in two). Input checks that
need such a read are skipped there; the callers in those regions pass values they made themselves."""
import torch


def host_reads_forbidden(t: torch.Tensor) -> bool:
    """True inside torch.compile, or while a CUDA graph captures on t's device."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())
