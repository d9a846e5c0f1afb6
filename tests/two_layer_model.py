"""The two-layer `tiny` (one KDA layer, then one MLA layer) shared by the tests of what surrounds the model: the
grammar, the tools API, the vision tower. It keeps both mixer kinds; a 6-layer model made those tests several times
slower, and what they check is decided outside the model."""
import contextlib

import torch

from k3 import K3Config, K3ForCausalLM
from k3.serve import EngineConfig, LLMEngine


def two_layer_config() -> K3Config:
    return K3Config.preset("tiny").replace(num_hidden_layers=2, attn_res_block_size=1,
                                           linear_attn_config={"full_attn_layers": [2], "kda_layers": [1]})


@contextlib.contextmanager
def two_layer_engine(tok, seed: int):
    """An engine over the two-layer model initialised from `seed`, on one thread (restored after)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(two_layer_config())
    model.reset_parameters(seed=seed)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLMEngine(model.eval(), tok, EngineConfig(memory_bytes=32 << 20, block_size=16, match_unit=4,
                                                        max_batch_tokens=512, max_num_seqs=16, max_model_len=1024))
    finally:
        torch.set_num_threads(n)
