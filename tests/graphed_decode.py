"""The GPU tests' common decode case: a bf16 `tiny` on CUDA, a chunked prefill, then a CUDA-graphed decode step
(k3.model.cuda_graph.GraphedDecodeStep) token by token. A kernel's test captures it with and without the kernel
(under the switches it names) and compares both with each other and with the full forward."""
import torch

from k3 import K3Config, K3ForCausalLM


def bf16_tiny(seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.preset("tiny")).cuda().to(torch.bfloat16).eval()


def graphed_decode_logits(model, ids: torch.Tensor, prompt_len: int, compile: bool = False) -> torch.Tensor:
    """[B, n, V] logits of the graphed decode of ids[:, prompt_len:] (n tokens), the cache filled by a chunked
    prefill of ids[:, :prompt_len] in chunks of 16. Each step's logits are copied out of the graph's buffer."""
    from k3.model.cuda_graph import GraphedDecodeStep
    from k3.model.generate import chunked_prefill

    B, total = ids.shape
    with torch.no_grad():
        cache = model.new_cache(B, total)
        chunked_prefill(model, ids[:, :prompt_len], cache, 16)
        step = GraphedDecodeStep(model, cache, compile=compile)
        return torch.stack([step.step(ids[:, t]).clone() for t in range(prompt_len, total)], 1)
