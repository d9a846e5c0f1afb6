"""Rank-sharded loading: every rank's part, reassembled, is the full load bit for bit (2 and 4 EP ranks, with and
without 2-way head slicing, packed and unpacked experts, MXFP4 and bf16 files); a rank opens only the shards
the index says it needs and reads only its own experts and head blocks."""
import json
import re

import pytest
import torch

import k3.checkpoint.sharded as sharded
from k3 import K3Config, K3ForCausalLM
from k3.checkpoint.hf import CheckpointError, load_pretrained
from k3.checkpoint.sharded import RankLayout, load_rank_shard

E = 16  # tiny's routed experts


def config() -> K3Config:
    return K3Config.preset("tiny").replace(moe_intermediate_size=96, vocab_size=512)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    torch.manual_seed(0)
    model = K3ForCausalLM(config()).eval()
    out = {}
    for fmt in ("mxfp4", "bf16"):
        path = tmp_path_factory.mktemp(fmt)
        model.save_pretrained(path, experts=fmt, max_shard_bytes=30_000)  # many shards, experts spread over them
        out[fmt] = path
    return out


@pytest.fixture(scope="module")
def full(dirs):
    return {(fmt, packed): load_pretrained(dirs[fmt], packed_experts=packed).state_dict()
            for fmt in dirs for packed in (False, True)}


def expert_ranks_of(name: str, ep: int):
    m = re.search(r"\.experts\.(\d+)\.", name)
    return None if m is None else int(m.group(1)) // (E // ep)


# Written out here from SPEC §2's head-major shapes: the dim each tensor is split along under tensor parallelism
# (attention by heads, MLPs by intermediate width, embedding and lm_head by vocabulary).
TP_SPLIT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "g_proj": 0, "q_conv1d": 0, "k_conv1d": 0, "v_conv1d": 0,
            "f_b_proj": 0, "b_proj": 0, "A_log": 0, "dt_bias": 0, "q_b_proj": 0, "kv_b_proj": 0, "o_proj": 1}
MLP_SPLIT = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}


def head_dim_of(name: str):
    name = name.removeprefix("language_model.")
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    m = re.search(r"(self_attn|mlp|shared_experts)\.(\w+?)(\.weight)?$", name)
    if m is None:
        return None
    return (TP_SPLIT if m.group(1) == "self_attn" else MLP_SPLIT).get(m.group(2))


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("ep,tp", [(2, 1), (4, 1), (2, 2)])
def test_rank_shards_reassemble_to_the_full_load(dirs, full, fmt, packed, ep, tp):
    want = full[(fmt, packed)]
    shards = {(l.ep_rank, l.tp_rank): load_rank_shard(dirs[fmt], l, packed_experts=packed)
              for l in RankLayout.all(ep, tp)}
    names = set()
    for (er, tr), s in shards.items():
        assert s.experts == range(er * E // ep, (er + 1) * E // ep)
        names |= set(s.tensors)
    assert names == set(want)
    for name, t in want.items():
        if ".experts.w" in name:  # each EP rank's block, in rank order (tp ranks hold the same experts)
            for tr in range(tp):
                got = torch.cat([shards[(er, tr)].tensors[name] for er in range(ep)])
                assert got.dtype == t.dtype and torch.equal(got, t), name
            continue
        dim = head_dim_of(name) if tp > 1 else None
        for er in range(ep):
            if dim is None:
                for tr in range(tp):
                    got = shards[(er, tr)].tensors[name]
                    assert got.dtype == t.dtype and torch.equal(got, t), name
            else:
                parts = [shards[(er, tr)].tensors[name] for tr in range(tp)]
                assert all(p.shape[dim] == t.shape[dim] // tp for p in parts), name
                assert torch.equal(torch.cat(parts, dim), t), name
                assert [shards[(er, tr)].slices[name] for tr in range(tp)] == \
                    [(dim, tr * t.shape[dim] // tp, (tr + 1) * t.shape[dim] // tp) for tr in range(tp)]


class CountingShard:
    """Wraps a safetensors handle: records every tensor whose bytes are read, and how many elements."""

    def __init__(self, handle, log):
        self.handle, self.log = handle, log

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_slice(self, name):
        return CountingSlice(self.handle.get_slice(name), name, self.log)

    def get_tensor(self, name):
        t = self.handle.get_tensor(name)
        self.log.append((name, t.numel()))
        return t


class CountingSlice:
    def __init__(self, sl, name, log):
        self.sl, self.name, self.log = sl, name, log

    def get_shape(self):
        return self.sl.get_shape()

    def get_dtype(self):
        return self.sl.get_dtype()

    def __getitem__(self, index):
        t = self.sl[index]
        self.log.append((self.name, t.numel()))
        return t


@pytest.mark.parametrize("ep,tp", [(2, 2), (4, 1)])
def test_a_rank_opens_only_its_shards_and_reads_only_its_bytes(dirs, monkeypatch, ep, tp):
    path = dirs["mxfp4"]
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    opened, reads = [], []
    real = sharded.open_shard

    def counting_open(f):
        opened.append(f.name)
        return CountingShard(real(f), reads)

    monkeypatch.setattr(sharded, "open_shard", counting_open)
    with safe_open_all(path) as shapes:
        skipped_somewhere = False
        for layout in RankLayout.all(ep, tp):
            opened.clear(), reads.clear()
            load_rank_shard(path, layout, packed_experts=True)
            # exactly the shards holding a tensor this rank needs, each once
            need = {f for n, f in weight_map.items() if expert_ranks_of(n, ep) in (None, layout.ep_rank)}
            assert sorted(opened) == sorted(need)
            skipped_somewhere |= len(need) < len(set(weight_map.values()))
            for name, numel in reads:
                assert expert_ranks_of(name, ep) in (None, layout.ep_rank), name  # never another rank's expert
                logical = 4 if name.endswith("A_log") else _numel(shapes[name])  # A_log: 4 heads, stored padded to 128
                split = tp > 1 and head_dim_of(name) is not None
                assert numel == (logical // tp if split else logical), name
        assert skipped_somewhere  # the test's checkpoint really has shards some rank does not need


class safe_open_all:
    """name → full shape over a directory's shards (headers only)."""

    def __init__(self, path):
        from safetensors import safe_open
        self.shapes = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                self.shapes |= {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}

    def __enter__(self):
        return self.shapes

    def __exit__(self, *exc):
        return False


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_host_memory_stays_within_the_largest_read(dirs):
    for packed in (False, True):
        s = load_rank_shard(dirs["mxfp4"], RankLayout(1, 2), packed_experts=packed)
        # tensors read from files are dropped as soon as they are placed (an MXFP4 pair lives until both halves)
        assert s.stats["peak_live_bytes"] <= 2 * s.stats["largest_read_bytes"]
    # read: the tensors of the file that are not another rank's experts (A_log without its padding), nothing more
    from safetensors import safe_open
    want = 0
    for f in dirs["mxfp4"].glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if expert_ranks_of(k, 4) in (None, 3):
                    t = h.get_tensor(k)
                    want += (4 if k.endswith("A_log") else t.numel()) * t.element_size()
    quarter = load_rank_shard(dirs["mxfp4"], RankLayout(3, 4), packed_experts=True)
    assert quarter.stats["read_bytes"] == want


def test_layout_errors_name_the_field(dirs):
    with pytest.raises(ValueError, match="ep_rank 2 must lie in 0..ep-1"):
        RankLayout(2, 2)
    with pytest.raises(ValueError, match="expert parallel size 3 must divide the number of routed experts 16"):
        load_rank_shard(dirs["mxfp4"], RankLayout(0, 3))
    with pytest.raises(ValueError, match="tensor parallel size 3 must divide the 4 attention heads"):
        load_rank_shard(dirs["mxfp4"], RankLayout(0, 1, 0, 3))


def test_a_missing_own_shard_is_reported_but_another_ranks_is_not_needed(dirs, tmp_path):
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(dirs["mxfp4"], path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    # a shard that holds only rank 1's experts (of 2): rank 0 loads without it, rank 1 names it
    only_rank1 = next(f for f in sorted(set(weight_map.values()))
                      if {expert_ranks_of(n, 2) for n, g in weight_map.items() if g == f} == {1})
    (path / only_rank1).unlink()
    load_rank_shard(path, RankLayout(0, 2))
    with pytest.raises(CheckpointError, match=f"shard file missing: {only_rank1}"):
        load_rank_shard(path, RankLayout(1, 2))


def test_a_wrong_tensor_of_its_own_is_named_and_another_ranks_is_never_read(dirs, tmp_path):
    """A rank checks what it reads (shape, dtype) and reports every problem in one error; a broken expert that
    belongs to another rank is not its business (it never reads it)."""
    import shutil

    from safetensors.torch import load_file, save_file
    path = tmp_path / "ckpt"
    shutil.copytree(dirs["mxfp4"], path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    bad = "language_model.model.layers.1.block_sparse_moe.experts.12.w2.weight_packed"  # rank 1 of 2
    f = path / weight_map[bad]
    tensors = load_file(str(f))
    tensors[bad] = tensors[bad][:, :-1].contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    load_rank_shard(path, RankLayout(0, 2), packed_experts=True)
    with pytest.raises(CheckpointError, match=re.escape(f"{bad}: shape (64, 47), expected (64, 48)")):
        load_rank_shard(path, RankLayout(1, 2), packed_experts=True)
