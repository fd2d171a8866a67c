"""Tensor parallel as a transformation of a loaded model (gpt-fast's way): every decoder layer
is cut to one rank's share, and the few places where the ranks' partial results meet get a
collective. The model code does not change.

    layer input x [T, hidden] (the same on every rank)
      qkv_proj   column-parallel: the rank's q heads and the KV heads they read  [T, (h + 2 g) D]
      attention  on the rank's heads only, over the rank's own KV cache (its g heads)
      o_proj     row-parallel: the rank's h D inputs -> a partial [T, hidden], all-reduced
      gate_up    column-parallel: the rank's slice of the intermediate size
      down_proj  row-parallel: that slice's inputs -> a partial [T, hidden], all-reduced
    embed_tokens vocab-parallel: the rank's rows; ids outside them give 0; all-reduced
    lm_head      vocab-parallel: the rank's rows' logits, all-gathered to [T, vocab]

Heads are split by KV groups, so a rank's q heads read only KV heads it holds: 3 KV heads of
3 q heads each on 2 ranks give 6 + 3 q heads. With fewer KV heads than ranks each KV head is
replicated on tp / num_kv_heads ranks, which split its q heads. Cuts along a quantized
weight's inputs fall on its scale groups (``QuantMethod.column_unit``), so no weight changes:
every rank computes exactly its share of the unsplit model's arithmetic, and only the order of
the all-reduce's additions differs (greedy tokens equal TP=1: tests/distributed).

Every rank runs the same steps with the same inputs, samples from the same gathered logits
with the same generators, and so needs no messages beyond these collectives.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from memwall.config import ModelArchConfig
from memwall.distributed.communicator import Communicator

if TYPE_CHECKING:
    from memwall.loader.slicing import TensorSlice


class ShardError(ValueError):
    """The model cannot be cut this way; the message says why and what would work."""


@dataclass(frozen=True)
class TPShard:
    """What one tensor-parallel rank holds: [start, stop) ranges of the unsplit model's heads,
    KV heads, intermediate features and vocabulary rows."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]
    vocab_sizes: tuple[int, ...]
    """Every rank's vocabulary rows, in rank order (the logits' all-gather)."""

    def describe(self) -> str:
        q, kv, i = self.q_heads, self.kv_heads, self.inter
        return (f"q heads {q[0]}-{q[1] - 1}, KV heads {kv[0]}-{kv[1] - 1}, MLP columns "
                f"{i[0]}-{i[1] - 1}, vocab rows {self.vocab[0]}-{self.vocab[1] - 1}")


def even_split(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[start, stop) of ``parts`` contiguous pieces of ``total`` cut at multiples of ``unit``,
    the first pieces one unit larger when it does not divide evenly."""
    if total % unit:
        raise ShardError(f"{total} cannot be cut in pieces of {unit}")
    units = total // unit
    if units < parts:
        raise ShardError(f"{total} ({units} pieces of {unit}) cannot be split over {parts} ranks")
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for p in range(parts):
        stop = start + (base + (p < extra)) * unit
        bounds.append((start, stop))
        start = stop
    return bounds


def head_split(num_heads: int, num_kv_heads: int, size: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(q heads, KV heads) ranges of each rank (see the module docstring)."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv = even_split(num_kv_heads, size)
        return [((a * group, b * group), (a, b)) for a, b in kv]
    if size % num_kv_heads or group % (size // num_kv_heads):
        raise ShardError(f"{num_kv_heads} KV heads of {group} query heads each cannot be shared "
                         f"by {size} ranks: with fewer KV heads than ranks, the ranks must be a "
                         f"multiple of the KV heads and split each group evenly; try "
                         f"tensor_parallel_size {num_kv_heads} or a divisor of it")
    replicas = size // num_kv_heads
    per_rank = group // replicas
    out = []
    for r in range(size):
        kv = r // replicas
        start = kv * group + (r % replicas) * per_rank
        out.append(((start, start + per_rank), (kv, kv + 1)))
    return out


def plan(arch: ModelArchConfig, size: int, inter_unit: int = 1) -> list[TPShard]:
    """Every rank's shard of ``arch`` over ``size`` ranks; ``inter_unit``: the down
    projection's input cut unit (its quantization's scale group)."""
    heads = head_split(arch.num_attention_heads, arch.num_key_value_heads, size)
    inter = even_split(arch.intermediate_size, size, inter_unit)
    vocab = even_split(arch.vocab_size, size)
    sizes = tuple(b - a for a, b in vocab)
    return [TPShard(r, size, heads[r][0], heads[r][1], inter[r], vocab[r], sizes)
            for r in range(size)]


# --------------------------------------------------------------------------- loading a slice

@dataclass(frozen=True)
class RankLayout:
    """A rank's ``ShardLayout`` (memwall/loader/slicing.py): the loader builds ``arch`` (the
    rank's heads, KV heads, MLP columns and vocabulary rows) and reads only ``slice_of`` each
    checkpoint tensor; ``shard_model`` then only adds the collectives."""

    full: ModelArchConfig
    shard: TPShard

    @property
    def arch(self) -> ModelArchConfig:
        s = self.shard
        return dataclasses.replace(
            self.full, num_attention_heads=s.q_heads[1] - s.q_heads[0],
            num_key_value_heads=s.kv_heads[1] - s.kv_heads[0],
            intermediate_size=s.inter[1] - s.inter[0], vocab_size=s.vocab[1] - s.vocab[0])

    def slice_of(self, name: str) -> "TensorSlice | None":
        from memwall.loader.slicing import TensorSlice
        d, s, cfg = self.full.head_dim, self.shard, self.full
        (q0, q1), (g0, g1), (i0, i1) = s.q_heads, s.kv_heads, s.inter
        q_rows, kv_rows = (q0 * d, q1 * d), (g0 * d, g1 * d)
        leaf = ".".join(name.split(".")[-2:])  # e.g. "q_proj.weight"
        module = leaf.split(".")[0]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return TensorSlice(rows=(s.vocab,))
        if module == "q_proj":
            return TensorSlice(rows=(q_rows,))
        if module in ("k_proj", "v_proj"):
            return TensorSlice(rows=(kv_rows,))
        if module == "qkv_proj":  # a fused checkpoint (Phi-3): the rank's q, k and v rows
            q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
            return TensorSlice(rows=(q_rows, _shift(kv_rows, q_size), _shift(kv_rows, q_size + kv_size)))
        if module in ("gate_proj", "up_proj"):
            return TensorSlice(rows=((i0, i1),))
        if module == "gate_up_proj":
            return TensorSlice(rows=((i0, i1), _shift((i0, i1), cfg.intermediate_size)))
        if leaf == "o_proj.weight":
            return TensorSlice(cols=q_rows)
        if leaf == "down_proj.weight":
            return TensorSlice(cols=(i0, i1))
        return None  # norms, row-parallel biases (kept by rank 0 only: shard_model)


def _shift(r: tuple[int, int], by: int) -> tuple[int, int]:
    return r[0] + by, r[1] + by


def rank_layout(rank: int, size: int):
    """For the loader (``load_model(tensor_parallel=...)``): given the model's arch and the
    unit its down projection's inputs may be cut at, rank ``rank``'s layout."""
    def layout_of(arch: ModelArchConfig, inter_unit: int = 1) -> RankLayout:
        return RankLayout(arch, plan(arch, size, inter_unit)[rank])
    return layout_of


# --------------------------------------------------------------------------- cutting modules

def take_rows(module: nn.Module, index: torch.Tensor) -> nn.Module:
    """A projection computing only output features ``index`` of ``module``."""
    if type(module) is nn.Linear:
        cut = nn.Linear(module.in_features, len(index), bias=module.bias is not None,
                        dtype=module.weight.dtype, device=module.weight.device)
        with torch.no_grad():
            cut.weight.copy_(module.weight.index_select(0, index))
            if module.bias is not None:
                cut.bias.copy_(module.bias.index_select(0, index))
        return cut.requires_grad_(False)
    from memwall.quant.base import QuantLinear
    if isinstance(module, QuantLinear):
        weights = module.method.take_rows(module, index)
        if weights is not None:
            bias = None if module.bias is None else module.bias.index_select(0, index)
            return QuantLinear(weights, bias)
    raise ShardError(f"{_name(module)} cannot be split by output rows")


def take_columns(module: nn.Module, start: int, stop: int, keep_bias: bool) -> nn.Module:
    """A projection of ``module``'s inputs start..stop-1 only: its output is a partial sum.
    The bias is added by one rank only (``keep_bias``), or the all-reduce would add it N times."""
    if type(module) is nn.Linear:
        bias = module.bias is not None and keep_bias
        cut = nn.Linear(stop - start, module.out_features, bias=bias, dtype=module.weight.dtype,
                        device=module.weight.device)
        with torch.no_grad():
            cut.weight.copy_(module.weight[:, start:stop])
            if bias:
                cut.bias.copy_(module.bias)
        return cut.requires_grad_(False)
    from memwall.quant.base import QuantLinear
    if isinstance(module, QuantLinear):
        weights = module.method.take_columns(module, start, stop)
        if weights is not None:
            return QuantLinear(weights, module.bias if keep_bias else None)
    raise ShardError(f"{_name(module)} cannot be split by inputs")


def column_unit(module: nn.Module) -> int:
    """Inputs of ``module`` may be cut only at multiples of this."""
    if type(module) is nn.Linear:
        return 1
    method = getattr(module, "method", None)
    unit = method.column_unit(module) if method is not None else None
    if unit is None:
        raise ShardError(f"{_name(module)} cannot be split by inputs")
    return unit


def _name(module: nn.Module) -> str:
    method = getattr(module, "method", None)
    if method is None:
        return type(module).__name__
    return (f"a {type(method).__name__} weight ({getattr(module, 'source', '')}); tensor "
            f"parallel cuts float, GGUF-native and int8/fp8 weights: load with another "
            f"--quantization")


class RowParallel(nn.Module):
    """A row-parallel projection: the rank's partial product, summed over the ranks."""

    def __init__(self, inner: nn.Module, comm: Communicator) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)  # [T, out], this rank's share of the sum
        return self.comm.all_reduce(y)


class VocabParallelEmbedding(nn.Module):
    """The rank's rows [start, stop) of the table; the ranks' lookups are summed (each token's
    row is on exactly one rank, zeros elsewhere, so the sum is that row bit for bit)."""

    def __init__(self, inner: nn.Module, start: int, stop: int, comm: Communicator) -> None:
        super().__init__()
        self.inner, self.start, self.stop, self.comm = inner, start, stop, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.stop - self.start)
        x = self.inner(torch.where(inside, local, torch.zeros_like(local)))  # [..., hidden]
        x = x.masked_fill(~inside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(x)


class VocabParallelHead(nn.Module):
    """The rank's vocabulary rows of the LM head; logits all-gathered to [T, vocab]."""

    def __init__(self, inner: nn.Module, sizes: tuple[int, ...], comm: Communicator) -> None:
        super().__init__()
        self.inner, self.sizes, self.comm = inner, sizes, comm
        self.in_features, self.out_features = inner.in_features, sum(sizes)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(self.inner(hidden), list(self.sizes))  # [T, vocab]


# --------------------------------------------------------------------------- the model

def shard_model(net: nn.Module, comm: Communicator) -> ModelArchConfig:
    """Cuts a loaded Llama-shaped model (``net.model.layers[i].self_attn/mlp``, fused or separate
    projections) in place to rank ``comm.rank``'s share of ``comm.size``; returns the rank's
    arch (its heads, KV heads and intermediate size: what its KV cache and kernels are sized
    by)."""
    cfg: ModelArchConfig = net.config
    if getattr(net, "lora_slots", None) is not None:
        raise ShardError("LoRA adapters cannot run on a tensor-parallel model yet")
    layout: RankLayout | None = getattr(net, "tp_layout", None)
    if layout is not None:  # the loader read only this rank's slice: add the collectives
        return _add_collectives(net, layout, comm)
    unit = math.lcm(*(column_unit(layer.mlp.down_proj) for layer in net.model.layers))
    shard = plan(cfg, comm.size, unit)[comm.rank]
    for layer in net.model.layers:
        _shard_attention(layer.self_attn, cfg, shard, comm)
        _shard_mlp(layer.mlp, cfg, shard, comm)
    _shard_vocab(net, shard, comm)
    return _localize(net, shard, comm)


def _localize(net: nn.Module, shard: TPShard, comm: Communicator) -> ModelArchConfig:
    """``net.config`` (the whole model's, or a pipeline stage's) becomes the rank's: its heads,
    KV heads and MLP width (what its KV cache and kernels are sized by); the vocabulary stays
    whole (the head's logits are gathered)."""
    local = dataclasses.replace(
        net.config, num_attention_heads=shard.q_heads[1] - shard.q_heads[0],
        num_key_value_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.inter[1] - shard.inter[0])
    net.config = local
    net.tp_comm = comm  # the fused decode step all-reduces through it (kernels/cpu/decode.py)
    net.tp_shard = shard
    return local


def _add_collectives(net: nn.Module, layout: RankLayout, comm: Communicator) -> ModelArchConfig:
    """A model loaded as ``layout`` (every weight already the rank's slice) gets its
    all-reduces and vocabulary-parallel ends; a row-parallel bias stays on rank 0 only."""
    shard = layout.shard
    if (shard.rank, shard.size) != (comm.rank, comm.size):
        raise ShardError(f"the model was loaded as rank {shard.rank} of {shard.size}, but runs "
                         f"as rank {comm.rank} of {comm.size}")
    for layer in net.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallel(_bias_on_first(attn.o_proj, shard.rank), comm)
        mlp.down_proj = RowParallel(_bias_on_first(mlp.down_proj, shard.rank), comm)
    v0, v1 = shard.vocab
    if net.model.embed_tokens is not None:
        net.model.embed_tokens = VocabParallelEmbedding(net.model.embed_tokens, v0, v1, comm)
    if net.lm_head is not None:
        net.lm_head = VocabParallelHead(net.lm_head, shard.vocab_sizes, comm)
    del net.tp_layout
    return _localize(net, shard, comm)


def _bias_on_first(module: nn.Module, rank: int) -> nn.Module:
    if rank != 0 and getattr(module, "bias", None) is not None:
        module.bias = None  # the all-reduce would add it once per rank
    return module


def _shard_attention(attn: nn.Module, cfg: ModelArchConfig, shard: TPShard, comm: Communicator) -> None:
    d = cfg.head_dim
    (q0, q1), (g0, g1) = shard.q_heads, shard.kv_heads
    q_rows = torch.arange(q0 * d, q1 * d)
    kv_rows = torch.arange(g0 * d, g1 * d)
    if attn.qkv_proj is not None:
        q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        index = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
        attn.qkv_proj = take_rows(attn.qkv_proj, index)
    else:
        attn.q_proj = take_rows(attn.q_proj, q_rows)
        attn.k_proj = take_rows(attn.k_proj, kv_rows)
        attn.v_proj = take_rows(attn.v_proj, kv_rows)
    unit = column_unit(attn.o_proj)
    if (q0 * d) % unit or (q1 * d) % unit:
        raise ShardError(f"o_proj's inputs are cut at multiples of {unit}; heads of {d} at "
                         f"{q0}..{q1} do not fall on them")
    attn.o_proj = RowParallel(take_columns(attn.o_proj, q0 * d, q1 * d, shard.rank == 0), comm)
    attn.num_heads, attn.num_kv_heads = q1 - q0, g1 - g0


def _shard_mlp(mlp: nn.Module, cfg: ModelArchConfig, shard: TPShard, comm: Communicator) -> None:
    i0, i1 = shard.inter
    rows = torch.arange(i0, i1)
    if mlp.gate_up_proj is not None:
        mlp.gate_up_proj = take_rows(mlp.gate_up_proj,
                                     torch.cat([rows, cfg.intermediate_size + rows]))
    else:
        mlp.gate_proj = take_rows(mlp.gate_proj, rows)
        mlp.up_proj = take_rows(mlp.up_proj, rows)
    mlp.down_proj = RowParallel(take_columns(mlp.down_proj, i0, i1, shard.rank == 0), comm)


def _shard_vocab(net: nn.Module, shard: TPShard, comm: Communicator) -> None:
    """embed_tokens and lm_head to the rank's vocabulary rows; a tied pair stays one table."""
    v0, v1 = shard.vocab
    rows = torch.arange(v0, v1)
    embed, head = net.model.embed_tokens, net.lm_head  # a pipeline stage may hold one, or none
    tied = net.config.tie_word_embeddings
    local_head = take_rows(head, rows) if head is not None else None
    if embed is None:
        local_embed = None
    elif tied and type(embed) is nn.Embedding and type(local_head) is nn.Linear:
        local_embed = nn.Embedding(v1 - v0, embed.embedding_dim, _weight=local_head.weight)
    else:
        local_embed = _embedding_rows(embed, v0, v1, local_head if tied else None)
    if local_embed is not None:
        net.model.embed_tokens = VocabParallelEmbedding(local_embed, v0, v1, comm)
    if local_head is not None:
        net.lm_head = VocabParallelHead(local_head, shard.vocab_sizes, comm)


def _embedding_rows(embed: nn.Module, v0: int, v1: int, tied_head: nn.Module | None) -> nn.Module:
    """Rows v0..v1-1 of an nn.Embedding or a QuantEmbedding (sharing a tied head's cut
    buffers, as the unsplit ones shared theirs)."""
    from memwall.quant.base import QuantWeights
    from memwall.quant.embedding import QuantEmbedding
    if type(embed) is nn.Embedding:
        weight = embed.weight.detach()[v0:v1].clone()
        return nn.Embedding(v1 - v0, embed.embedding_dim, _weight=weight).requires_grad_(False)
    if isinstance(embed, QuantEmbedding):
        if embed.panels is not None:
            raise ShardError("the token embedding was packed into panels before sharding; "
                             "shard the model first (memwall/quant/packing.py)")
        if tied_head is not None and all(hasattr(tied_head, n) for n in ("codes", "s", "c")):
            tensors = {n: getattr(tied_head, n) for n in ("codes", "s", "c")}
        else:
            tensors = {n: getattr(embed, n)[v0:v1].contiguous() for n in ("codes", "s", "c")}
        method = tied_head.method if tied_head is not None else _embedding_method(embed)
        return QuantEmbedding(QuantWeights(method, tensors, v1 - v0, embed.embedding_dim,
                                           embed.source))
    raise ShardError(f"a token embedding of type {type(embed).__name__} cannot be split")


def _embedding_method(embed: nn.Module):
    from memwall.quant.int4_cpu import NativeQ4
    from memwall.quant.int8_cpu import NativeQ8
    return NativeQ4() if embed.four_bit else NativeQ8()


__all__ = ["TPShard", "RankLayout", "rank_layout", "ShardError", "plan", "shard_model", "head_split", "even_split",
           "RowParallel", "VocabParallelEmbedding", "VocabParallelHead"]
