"""EAGLE-style draft heads (Li et al., EAGLE-1/2 layout): one Llama decoder layer that drafts
in the target's feature space.

    feature f_t   the target's last hidden state at position t (after its final norm)
    input t       fc(cat(embed(x_{t+1}), f_t))          embed: the target's token embedding
    layer         one decoder layer, no input norm (the fc output goes in as it is)
    output        a predicted f_{t+1}; the target's LM head turns it into the draft x_{t+2},
                  and (embed(x_{t+2}), predicted f_{t+1}) is the next input

Published checkpoints (e.g. yuhuili/EAGLE-llama2-chat-7B) are a directory with a Llama
``config.json`` (``num_hidden_layers`` 1) and ``fc.weight`` [H, 2H] (``fc.bias`` when
``bias`` is set), ``layers.0.*`` in the Hugging Face names, optionally ``embed_tokens.weight``
(a copy of the target's, not used) and ``layers.0.input_layernorm.weight`` (not applied in
layer 0), in ``model.safetensors`` or ``pytorch_model.bin``. ``load_eagle_head`` reads that
layout; ``benchmarks/train_eagle.py`` is to write it.

``EagleProposer`` drafts with it: the runner hands it the target's final hidden states every
step (``Proposer.record``), its paged cache catches up on them, then it drafts k greedy tokens.
The target's LM head is most of a drafted token's cost; ``draft_vocab_size`` cuts it to the
first ids' rows (draft_vocab.py). A head trained among the first N ids says so in its
config.json (``"draft_vocab_size": N``, EAGLE-3's key; train_eagle.py writes it), and drafts
among them by default.
"""

from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from memwall.attention.metadata import AttentionMetadata
from memwall.config import ModelArchConfig, is_whole_number
from memwall.layers.rotary import RotaryEmbedding
from memwall.models.llama import DecoderLayer, KVCache
from memwall.sample.sampler import argmax_rows
from memwall.spec_decode.draft_cache import DraftCache
from memwall.spec_decode.draft_model import ROWS_AS_DECODE
from memwall.spec_decode.proposer import DraftRequest, Proposer

UNUSED = ("embed_tokens.weight", "layers.0.input_layernorm.weight")


class EagleHeadError(ValueError):
    """A directory that is not an EAGLE head for this target (one line, for users)."""


class EagleHead(nn.Module):
    def __init__(self, arch: ModelArchConfig, fc_bias: bool,
                 draft_vocab_size: int | None = None) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.config = arch
        self.draft_vocab_size = draft_vocab_size
        """The first ids the head was trained to draft among (its config.json's
        ``draft_vocab_size``, as benchmarks/train_eagle.py writes it), or None: the whole
        vocabulary. The runner drafts among them unless the speculative config names its own."""
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(arch)])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                      arch.rope_scaling)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """token_embeds, features [T, H] (x_{t+1}'s embedding and f_t), positions [T] (t) ->
        predicted features [T, H] (f_{t+1}), the K/V of each t written to the head's cache."""
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        rope = self.rotary.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return x

    def quantize_for_cpu(self, method: str = "int8") -> str:
        """The head's matmuls as int8 codes with a scale per 32 values, as GGUF's Q8_0
        (``method`` "int4": 4-bit codes, a scale and an offset per 32 values), in the native
        kernels' packed panels, q/k/v and gate/up joined as in the target: a drafted token then
        reads ~4 MiB (int4 ~3 MiB) of the head's weights instead of ~17 MiB of float32
        (SmolLM2's shape). Only drafts come from it, and the target verifies them: output is
        unchanged. Returns what was quantized.

        Why 32-value groups, not a scale per row: per-row int8 does not fit the panels and
        took the row-layout kernels, whose fused step of the head's layer cost 0.52 ms against
        0.29 ms in int8 panels on a Cascade Lake Xeon, 2 threads (in the engine, medians): a
        drafting call 1.86 -> 1.41 ms."""
        from memwall.models.llama import fuse_layer_projections
        from memwall.quant.packing import pack_model
        from memwall.quant.transform import quantize_model

        report = quantize_model(self, method)
        for layer in self.layers:
            fuse_layer_projections(layer)
        pack_model(self)
        return report.summary()

    def native_view(self) -> SimpleNamespace:
        """The head's layer in the shape NativeDecoder describes to the fused C decode step (a
        one-layer model without input or final norm: it returns the layer's output, the
        predicted features)."""
        return SimpleNamespace(config=self.config, native_decode=True,
                               model=SimpleNamespace(layers=self.layers, rotary=self.rotary, norm=None))


def load_eagle_head(directory: str | Path, target: ModelArchConfig,
                    dtype: torch.dtype = torch.float32) -> EagleHead:
    """An EAGLE-1/2 head directory -> EagleHead, checked against the target's shape."""
    path = Path(directory).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise EagleHeadError(f"{path} has no config.json: not an EAGLE head directory")
    config = json.loads(config_file.read_text())
    layers = config.get("num_hidden_layers", 1)
    if layers != 1:
        raise EagleHeadError(f"{path}: an EAGLE head has one decoder layer, this config has {layers}")
    arch = ModelArchConfig.from_hf_dict({**config, "model_type": config.get("model_type", "llama")})
    if arch.hidden_size != target.hidden_size:
        raise EagleHeadError(f"{path}: hidden size {arch.hidden_size}, the target's is "
                             f"{target.hidden_size}: a head drafts for the model it was trained on")
    draft_vocab = config.get("draft_vocab_size")
    if draft_vocab is not None and (not is_whole_number(draft_vocab)
                                    or not 1 <= draft_vocab <= target.vocab_size):
        raise EagleHeadError(f"{path}: draft_vocab_size must be an integer in 1.."
                             f"{target.vocab_size} (the target's vocabulary), got {draft_vocab!r}")
    if draft_vocab == target.vocab_size:
        draft_vocab = None  # the whole vocabulary: nothing to cut
    weights = _read_weights(path)
    head = EagleHead(arch, fc_bias="fc.bias" in weights, draft_vocab_size=draft_vocab)
    params = dict(head.named_parameters())
    missing = sorted(set(params) - set(weights))
    unknown = sorted(set(weights) - set(params) - set(UNUSED))
    if missing or unknown:
        raise EagleHeadError(f"{path}: not the EAGLE head layout (missing {missing[:3]}, "
                             f"unexpected {unknown[:3]})")
    for name, param in params.items():
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise EagleHeadError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(param.shape)}")
        param.data.copy_(tensor)
    return head.to(dtype).eval()


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = path / "model.safetensors", path / "pytorch_model.bin"
    if safetensors_file.is_file():
        from safetensors.torch import load_file
        weights = load_file(str(safetensors_file))
    elif bin_file.is_file():
        weights = torch.load(bin_file, map_location="cpu", weights_only=True)  # no pickled code
    else:
        raise EagleHeadError(f"{path} has neither model.safetensors nor pytorch_model.bin")
    # some exports prefix the names as a submodule of the target ("model.")
    return {name.removeprefix("model."): tensor.float() for name, tensor in weights.items()}


class _Features:
    """A sequence's features, in a buffer that doubles as it fills (a drafting step reads the
    last few; keeping them as a list joined at every read copied the whole history each step)."""

    def __init__(self, base: int) -> None:
        self.base = base
        """The first position with a feature (0, unless the prompt's start came from the prefix
        cache: the target never computed those positions, and the head starts after them)."""
        self.count = 0
        self._buffer: torch.Tensor | None = None  # [capacity, hidden] float32

    def append(self, start: int, features: torch.Tensor) -> bool:
        """False when ``start`` does not continue what is held (the caller starts afresh)."""
        end = self.base + self.count
        if start > end or start < self.base:
            return False
        keep = start - self.base  # positions computed again (a rewound sequence): the new ones
        need = keep + features.shape[0]
        capacity = 0 if self._buffer is None else self._buffer.shape[0]
        if need > capacity:
            grown = torch.empty(max(need, 64, 2 * capacity), features.shape[-1],
                                dtype=torch.float32, device=features.device)
            if keep:
                grown[:keep] = self._buffer[:keep]
            self._buffer = grown
        self._buffer[keep:need] = features.detach()
        self.count = need
        return True

    def slice(self, lo: int, hi: int) -> torch.Tensor:
        """Features of positions lo .. hi - 1 (a view: read it before the next append)."""
        return self._buffer[lo - self.base:hi - self.base]


class EagleProposer(Proposer):
    """Drafts with an EAGLE head over the target's features (module docstring): each step the
    head's cache catches up on the positions the target made final, then k greedy tokens
    follow from its own predicted features. Greedy drafts: exact for any temperature."""

    wants_features = True

    def __init__(self, head: EagleHead, target: nn.Module, kv_caches: list[KVCache],
                 block_size: int, backend, logits=None, fast_path=None) -> None:
        """``target``: the target model (its token embedding and LM head are shared);
        ``logits``: predicted features -> the logits drafts are the argmax of (default: the
        target's whole head; draft_vocab.draft_head for a reduced vocabulary); ``fast_path``:
        the fused CPU decode step over the head's layer (worker/cpu_decode.FusedCpuDecode of
        ``head.native_view()``), which steps of a few entries a sequence take; None: the head's
        torch forward runs every step."""
        from memwall.attention.backend import bind as bind_attention

        self.head, self.target, self.backend = head, target, backend
        self.logits = logits if logits is not None else target.compute_logits
        self.cache = DraftCache(kv_caches, block_size)
        bind_attention(head, backend)
        self.fast_path = fast_path
        self.max_len = head.config.max_position_embeddings
        self.features: dict[str, _Features] = {}
        self.real: dict[str, int] = {}
        """Per sequence, how many head cache entries (entry i: position base + i) came from the
        target's features; entries past them hold the head's own predictions, redone each step."""

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    @property
    def drafting_model(self) -> SimpleNamespace:
        """What one drafted token runs, in the shape step_shape.measure_row_costs times: the
        head's matmuls and the LM head it drafts from (most of it with the whole vocabulary)."""
        layers = nn.ModuleList([self.head.fc, *self.head.layers])
        return SimpleNamespace(model=SimpleNamespace(layers=layers), config=self.target.config,
                               lm_head=self.logits, compute_logits=self.logits)

    def record(self, request_id: str, start: int, features) -> None:
        held = self.features.get(request_id)
        if held is None or not held.append(start, features):
            self._drop_cache(request_id)
            self.features[request_id] = _Features(base=start)
            self.features[request_id].append(start, features)
            return
        if request_id in self.real:  # entries past a rewritten position are stale
            self.real[request_id] = min(self.real[request_id], start - held.base)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.features.pop(request_id, None)
            self._drop_cache(request_id)

    def _drop_cache(self, request_id: str) -> None:
        self.real.pop(request_id, None)
        self.cache.release(request_id)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        active = []  # (request id, first position, k, base)
        inputs = []  # per active sequence: (first position, token ids, features) to feed next
        for req in requests:
            rid, held = req.request_id, self.features.get(req.request_id)
            n = len(req.token_ids) - 1  # features needed for positions .. n - 1
            if held is None or held.base + held.count != n or n <= held.base:
                continue  # the target has not made every position final (or a fork child)
            k = min(req.max_drafts, self.max_len - n)
            if k < 1:
                continue
            if not self.cache.reserve(rid, n - held.base + k - 1):
                self.real.pop(rid, None)  # its blocks went back to the pool
                continue
            # catch up from the first entry not made from real features; with nothing new
            # (cannot happen after a step) the last entry is redone for its prediction
            first = min(held.base + self.real.get(rid, 0), n - 1)
            active.append((rid, first, k, held.base))
            inputs.append((first, torch.as_tensor(req.token_ids[first + 1:n + 1]), held.slice(first, n)))
        drafts: dict[str, list[int]] = {rid: [] for rid, *_ in active}
        limits = [k for _, _, k, _ in active]
        for step in range(max(limits, default=0)):
            rows = [i for i, limit in enumerate(limits) if step < limit]
            predicted = self._forward([active[i] for i in rows], [inputs[i] for i in rows])
            tokens = argmax_rows(self.logits(predicted))
            for j, i in enumerate(rows):
                rid, first, _, base = active[i]
                if step == 0:
                    self.real[rid] = first - base + len(inputs[i][1])
                drafts[rid].append(int(tokens[j]))
                position = inputs[i][0] + len(inputs[i][1])  # the next entry's position
                inputs[i] = (position, tokens[j:j + 1], predicted[j:j + 1])
        return drafts

    def _forward(self, active, inputs) -> torch.Tensor:
        """Entries at positions first .. first + len - 1 for each sequence (token x_{t+1} and
        feature f_t each); returns the predicted feature after each sequence's last entry."""
        spans = [(rid, first - base, len(t)) for (rid, _, _, base), (first, t, _) in zip(active, inputs)]
        dev = self.cache.device
        positions = torch.tensor([p for first, t, _ in inputs for p in range(first, first + len(t))],
                                 dtype=torch.long, device=dev)
        ids = torch.cat([t.reshape(-1) for _, t, _ in inputs]).to(dev)
        feats = torch.cat([f for _, _, f in inputs]).to(dev)
        embeds = self.target.model.embed_tokens(ids).float()
        # a few entries a sequence (every draft step; a catch-up after a verify) as one-token
        # rows: the fused C step, as the draft model's feeds (draft_model.py)
        if (self.fast_path is not None and self.fast_path.use_native_decode
                and max(len(t) for _, t, _ in inputs) <= ROWS_AS_DECODE):
            x = self.head.fc(torch.cat([embeds, feats], dim=-1))  # the layer's input goes in
            # as a pipeline stage's input would (the C step starts from it, not the embeddings)
            out = self.fast_path.run_rows(ids, positions, *self.cache.rows(spans), x)
        else:
            attn = self.cache.metadata(self.backend, spans)
            out = self.head(embeds, feats, positions, self.cache.kv_caches, attn)
        if out.shape[0] == len(inputs):  # one entry a sequence (every draft after the first)
            return out
        return out[torch.tensor(list(accumulate(len(t) for _, t, _ in inputs)), device=dev) - 1]
