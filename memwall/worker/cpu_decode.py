"""FusedCpuDecode: the CPU twin of the CUDA-graph runner. A decode-only step (every sequence
adds one token) runs all layers of the model in one call into C (memwall/kernels/cpu/decode.c):
quantized matmuls, RMSNorm, rotary, paged attention over the blocks in place, SiLU.

The runner asks ``can_run`` each step and otherwise calls the model, whose attention goes
through the step's backend; both compute the same thing (tests/kernels/test_cpu_decode.py).
With LoRA (``model.lora_slots``, set by memwall.lora.layers.apply_lora) the C step adds each
sequence's adapter delta too, so a batch of mixed adapters stays one call
(tests/kernels/test_cpu_decode_lora.py).
"""

from __future__ import annotations

import torch

from memwall.attention.metadata import AttentionMetadata


class FusedCpuDecode:
    use_native_decode = True
    """Class-wide switch (tests and the quality benchmark turn the fused step off)."""

    def __init__(self, model: torch.nn.Module, decoder) -> None:
        self.model, self.decoder = model, decoder
        self.embed_scale = getattr(model.model, "embed_scale", None)
        self.runs_lora = decoder.model.n_slots > 0
        """The decoder was built with the model's LoRA slots: steps with adapters run here too."""

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches: list) -> "FusedCpuDecode | None":
        """None when the C step cannot compute this model (not float32, a layer it lacks, no
        compiler): the model's own forward then runs every step."""
        from memwall.kernels.cpu.decode import NativeDecoder

        decoder = NativeDecoder.build(model, kv_caches)
        return cls(model, decoder) if decoder is not None else None

    def can_run(self, attn: AttentionMetadata) -> bool:
        # sliding layers attend their window natively too (mw_layer.window), at any length
        return self.use_native_decode and not attn.prefill_seq_ids and attn.decode is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn: AttentionMetadata, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, hidden] after the final norm, like the model's forward (``hidden``: a
        pipeline stage's input from the stage before, instead of the embeddings). The LoRA slot
        of each sequence is the one the runner set for the step (``LoRASlots.set_step``: one
        token per sequence, in batch order, which is the C step's row order)."""
        batch = attn.decode
        return self.run_rows(input_ids, positions, attn.slot_mapping, batch.seq_lens,
                             batch.block_tables, hidden)

    def run_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 hidden: torch.Tensor | None = None) -> torch.Tensor:
        """``run`` from the arrays the C step reads (one row each: the slot its token's K/V go
        to, how many cached tokens it attends, its block table [B, W] int64): what a drafter
        builds for its one-token rows without the attention metadata (DraftCache.rows)."""
        if hidden is not None:
            embeddings = hidden.float().contiguous()  # [B, hidden]; the step overwrites it
        else:
            embeddings = self.model.model.embed_tokens(input_ids)  # [B, hidden]
        if hidden is None and self.embed_scale is not None:  # Gemma, as its forward scales them
            embeddings = embeddings * torch.tensor(self.embed_scale, dtype=embeddings.dtype)
        lora = getattr(self.model, "lora_slots", None)
        return self.decoder.step(embeddings, positions, slot_mapping, seq_lens, block_tables,
                                 lora.token_slots if lora is not None else None)
