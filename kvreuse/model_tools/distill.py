"""Distil an EAGLE-1 draft head for a target model (a folder or a GGUF file), offline, on a CPU, in minutes.

The models this project makes have random weights, so no published draft fits them; a draft trained
here predicts its own target well enough for demos and benchmarks to show a real acceptance rate.
``kvreuse distill-eagle TARGET OUT`` runs it; ``distill_eagle_draft`` is the same as a function.

1. data: prompts cut from the embedded corpus (``kvreuse/data/corpus.txt``; its first
   ``TRAIN_FRACTION`` only, the rest gives ``evaluate_draft`` its held-out prompts), each followed by
   the target's own greedy continuation, made by ``LLM.generate``: decode-time text is what a draft
   must predict;
2. targets: one full-sequence forward of the target (kvreuse's own model, float32, with a plain causal
   attention backend instead of the paged one) gives the feature f_p of every position (the final
   normed hidden state, what the engine stores per slot) and the target's greedy token after p. Its
   greedy tokens are checked against the engine's (``engine_agreement``, 1.0 in practice);
3. training: the draft is ``EagleDraft`` itself, its ``forward`` run with a training attention backend
   (``_TrainingAttention``), so the trained function is the one the engine runs, by construction. The
   entry at position p reads token p and f_{p-1} (a zero vector at p = 0) and is trained to give the
   target's greedy token after p (cross-entropy through the target's frozen lm_head, the logits
   scaled to ``sharpness`` / their spread, because a random target's logits are nearly flat) and to
   regress f_p (smooth L1, EAGLE's feature loss). The target's embedding and lm_head are frozen and
   not saved.

Chained drafting feeds the draft's own output feature forward, and a draft trained on true features
only is much worse at the second and later drafted tokens. So training unrolls ``depth`` chained
steps (the "training-time test" of HASS / EAGLE-3): the depth-d entry at p reads the depth-(d-1)
output at p - 1 and attends exactly what the engine's chain entry attends, the true entries up to
p - d and the chain entries p - d + 1 .. p, so every depth is trained on the inputs it sees at
decode time, given that the tokens before it were accepted.

The draft starts as a copy (``fc`` passes f_{p-1} through, the attention and MLP branches start at
zero), so it first predicts "the target's token after p-1 again"; sequences held out of training
(``val_fraction``) pick the checkpoint with the best expected accepted length on generated
positions, and training stops when that has not improved for ``patience`` validations. Both matter
for the random targets ``kvreuse make-model`` writes: a small one (``tiny``) has varied greedy
outputs and training takes its draft from ~3% to 25-55% top-1 agreement, while a deep one
(``smollm2-135m``) mostly repeats a context-dependent token, which the copy already predicts ~99% of
the time and which training on a few dozen sequences only overfits, so validation keeps the copy.

With a large vocabulary the lm_head dominates the cost (the draft layer is a few million weights, the
projection 49152 x 576 for smollm2), so the cross-entropy runs over a candidate vocabulary when the
target's is bigger than ``full_vocab_max``: every token the target predicts anywhere in the training
data plus the target's top ``candidate_top_k`` at every position. Top-1 agreement is always measured
over the full vocabulary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvreuse.attention.backend import AttentionBackend
from kvreuse.attention.forward_batch import ForwardBatch
from kvreuse.cache.kv import KVCache
from kvreuse.loading.gguf import is_gguf_path, read_gguf
from kvreuse.loading.loader import load_model, model_config_of, resolve_tokenizer_path
from kvreuse.model_tools.make_draft import (
    draft_config,
    random_draft_tensors,
    write_draft,
)
from kvreuse.models.config import ModelConfig
from kvreuse.models.llama import LlamaFamilyForCausalLM
from kvreuse.spec.eagle import DraftSpec, EagleDraft

TRAIN_FRACTION = 0.9  # of the corpus's tokens; the rest gives held-out prompts
DEFAULT_STEPS = 300
DEFAULT_SEQ_LEN = 128  # prompt + greedy continuation, in tokens
DEFAULT_GEN_TOKENS = 64  # of which the target's own greedy continuation
DEFAULT_NUM_SEQUENCES = 96
DEFAULT_BATCH_SIZE = 8
DEFAULT_DEPTH = 3  # chained steps trained (1: true features only)
DEFAULT_LR = 5e-3
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- data -------------------------------------------------------------------------------------------
def corpus_token_ids(tokenizer: Any, split: str = "train") -> list[int]:
    """The embedded corpus in the target's tokens: its first ``TRAIN_FRACTION`` ("train") or the rest
    ("heldout")."""
    from kvreuse.model_tools.make_model import CORPUS_PATH

    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    ids: list[int] = []
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines(keepends=True)
    for start in range(0, len(lines), 32):  # pieces, so no tokenizer warns about a long sequence
        ids += tokenizer.encode("".join(lines[start:start + 32]), add_special_tokens=False)
    cut = int(len(ids) * TRAIN_FRACTION)
    return ids[:cut] if split == "train" else ids[cut:]


def corpus_prompts(tokenizer: Any, count: int, length: int, seed: int, split: str = "train") -> list[list[int]]:
    """``count`` windows of ``length`` tokens at seeded random offsets of the corpus split."""
    ids = corpus_token_ids(tokenizer, split)
    if len(ids) <= length:
        raise ValueError(f"the corpus {split} split has {len(ids)} tokens, too few for {length}-token prompts")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (count,), generator=generator).tolist()
    return [ids[start:start + length] for start in starts]


def greedy_sequences(target_dir: str | os.PathLike[str], prompts: list[list[int]], gen_tokens: int) -> list[list[int]]:
    """prompt + the target's greedy continuation (``gen_tokens``, EOS ignored), through the engine."""
    from kvreuse.llm import LLM
    from kvreuse.sampling import SamplingParams

    llm = LLM(str(target_dir), dtype="float32", quantization="none",
              kv_cache_memory=_kv_memory(target_dir, prompts, gen_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    return [list(prompt) + list(output.outputs[0].token_ids) for prompt, output in zip(prompts, outputs)]


def _kv_memory(target_dir: str | os.PathLike[str], prompts: list[list[int]], gen_tokens: int) -> int:
    config = model_config_of(Path(target_dir))
    per_token = 2 * config.num_hidden_layers * config.kv_size * 4
    tokens = sum(len(prompt) + gen_tokens + 32 for prompt in prompts)
    return max(64 << 20, min(4 << 30, 2 * tokens * per_token))


# --- plain causal attention for full sequences ----------------------------------------------------------
@dataclass
class _Batch:
    """A [batch, length] block of equal-length sequences, flattened row-major into the model's [T]."""

    batch: int
    length: int
    keys: list[torch.Tensor] | None = field(default_factory=list)  # per chained depth so far: [B, KV, L, D]
    values: list[torch.Tensor] | None = field(default_factory=list)
    masks: dict[int, torch.Tensor] = field(default_factory=dict)


class _TrainingAttention(AttentionBackend):
    """Causal attention over whole sequences, no KV cache: the target's feature pass and the draft's
    training forward. Each call within one ``_Batch`` is one chained depth d of the draft; the query at
    position p of depth d attends the depth-0 entries at positions <= p - d and the depth-i entry at
    p - d + i for 1 <= i <= d (the engine's chain: true entries up to the last accepted position, then
    the chain's own entries). Depth 0 is plain causal attention."""

    def prepare(self, batch: ForwardBatch, block_size: int) -> Any:
        raise NotImplementedError("the training attention runs whole sequences, not engine batches")

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache | None, metadata: Any) -> torch.Tensor:
        meta: _Batch = metadata
        b, length = meta.batch, meta.length
        heads, head_dim = q.shape[1], q.shape[2]
        q4 = q.view(b, length, heads, head_dim).transpose(1, 2)
        k4 = k.view(b, length, k.shape[1], head_dim).transpose(1, 2)
        v4 = v.view(b, length, v.shape[1], head_dim).transpose(1, 2)
        depth = len(meta.keys) if meta.keys is not None else 0
        if depth == 0:
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
        else:
            assert meta.keys is not None and meta.values is not None
            keys = torch.cat([*meta.keys, k4], dim=2)
            values = torch.cat([*meta.values, v4], dim=2)
            out = F.scaled_dot_product_attention(q4, keys, values, attn_mask=self._mask(meta, depth, q.device),
                                                 enable_gqa=True)
        if meta.keys is not None:  # None: a single pass (the target's), nothing chains on it
            meta.keys.append(k4)
            assert meta.values is not None
            meta.values.append(v4)
        return out.transpose(1, 2).reshape(q.shape)

    @staticmethod
    def _mask(meta: _Batch, depth: int, device: torch.device) -> torch.Tensor:
        if depth not in meta.masks:
            length = meta.length
            p = torch.arange(length, device=device)[:, None]
            s = torch.arange(length, device=device)[None, :]
            blocks = [s <= p - depth] + [s == p - depth + i for i in range(1, depth + 1)]
            meta.masks[depth] = torch.cat(blocks, dim=1)  # [L, (depth + 1) L], True where attended
        return meta.masks[depth]


@torch.no_grad()
def target_features(target: LlamaFamilyForCausalLM, sequences: torch.Tensor, batch_size: int = 8
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """sequences [N, L] -> (features [N, L, H]: the final normed hidden state at every position, the
    target's greedy next token after every position [N, L])."""
    previous = target.attention_backend
    target.set_attention_backend(_TrainingAttention())
    features, labels = [], []
    try:
        for start in range(0, sequences.shape[0], batch_size):
            chunk = sequences[start:start + batch_size]
            b, length = chunk.shape
            positions = torch.arange(length).repeat(b)
            hidden = target(chunk.reshape(-1), positions, None, _Batch(b, length, keys=None))  # type: ignore[arg-type]
            features.append(hidden.float().view(b, length, -1))
            labels.append(target.compute_logits(hidden).argmax(dim=-1).view(b, length))
    finally:
        target.set_attention_backend(previous)
    return torch.cat(features), torch.cat(labels)


# --- the draft --------------------------------------------------------------------------------------
def _new_draft(target: LlamaFamilyForCausalLM, config: dict, seed: int, out_dir: Path) -> EagleDraft:
    shapes = ModelConfig.from_dict(dict(config, architectures=["LlamaForCausalLM"]))
    spec = DraftSpec("eagle", shapes, shapes.vocab_size, fc_bias=True, aux_layers=())
    draft = EagleDraft(spec, target, kv_layer=0, dtype=torch.float32, device=torch.device("cpu"))
    draft.load_tensors(random_draft_tensors(config, "eagle", seed, torch.float32), out_dir)
    draft.attention_backend = _TrainingAttention()
    for parameter in draft.parameters():
        parameter.requires_grad_(True)
    return draft


def draft_tensors(draft: EagleDraft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The draft's weights under their checkpoint names (the inverse of ``EagleDraft.load_tensors``)."""
    tensors = {}
    for name in draft.weight_names():
        parameter, rows = draft._parameter_of(name)
        tensor = parameter.detach() if rows is None else parameter.detach()[rows]
        tensors[name] = tensor.to(dtype).clone()
    return tensors


def _chained_forward(draft: EagleDraft, tokens: torch.Tensor, features: torch.Tensor, depth: int
                     ) -> list[torch.Tensor]:
    """tokens [B, L], target features [B, L, H] -> the draft's output rows [B, L, H] at each depth."""
    b, length = tokens.shape
    hidden_size = features.shape[-1]
    flat_tokens = tokens.reshape(-1)
    positions = torch.arange(length).repeat(b)
    zero = features.new_zeros(b, 1, hidden_size)
    inputs = torch.cat((zero, features[:, :-1]), dim=1)  # depth 0: f_{p-1}
    meta = _Batch(b, length)
    outputs = []
    for _ in range(depth):
        rows, next_features = draft(flat_tokens, positions, inputs.reshape(-1, hidden_size),
                                    None, meta)  # type: ignore[arg-type]
        outputs.append(rows.view(b, length, hidden_size))
        inputs = torch.cat((zero, next_features.view(b, length, hidden_size)[:, :-1]), dim=1)
    return outputs


def _lm_weight(draft: EagleDraft) -> torch.Tensor:
    return draft.target[0].lm_head_weight.detach().float()


def candidate_vocabulary(target: LlamaFamilyForCausalLM, features: torch.Tensor, labels: torch.Tensor,
                         top_k: int) -> torch.Tensor:
    """Every token the target predicts in the data plus its top ``top_k`` at every position (sorted)."""
    chosen = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    chosen[labels.reshape(-1)] = True
    with torch.no_grad():
        flat = features.reshape(-1, features.shape[-1])
        for start in range(0, flat.shape[0], 1024):
            logits = target.compute_logits(flat[start:start + 1024].to(target.dtype))
            chosen[logits.topk(top_k, dim=-1).indices.reshape(-1)] = True
    return chosen.nonzero().squeeze(1)


@torch.no_grad()
def top1_agreement(draft: EagleDraft, tokens: torch.Tensor, features: torch.Tensor, labels: torch.Tensor,
                   depth: int, first: int = 0, batch_size: int = 8) -> list[float]:
    """Per chained depth d, the fraction of positions p >= first + d where the draft's argmax over the
    full vocabulary is the target's greedy token (``first``: the first position that counts, e.g. the
    first generated token, where decode-time drafting starts)."""
    hits = [0] * depth
    counts = [0] * depth
    for start in range(0, tokens.shape[0], batch_size):
        outputs = _chained_forward(draft, tokens[start:start + batch_size], features[start:start + batch_size], depth)
        for d, rows in enumerate(outputs):
            predicted = draft.compute_logits(rows.reshape(-1, rows.shape[-1])).argmax(-1).view(rows.shape[:2])
            match = (predicted == labels[start:start + batch_size])[:, first + d:]
            hits[d] += int(match.sum())
            counts[d] += match.numel()
    return [hit / max(count, 1) for hit, count in zip(hits, counts)]


# --- the whole recipe ----------------------------------------------------------------------------------
@dataclass
class DistillData:
    """Training sequences with the target's feature and greedy next token at every position."""

    sequences: torch.Tensor  # [N, L] token ids
    features: torch.Tensor  # [N, L, H] float32
    labels: torch.Tensor  # [N, L] the target's greedy token after each position
    prompt_len: int = 0  # positions before this are corpus text, from it on the target's own tokens
    generate_seconds: float = 0.0
    features_seconds: float = 0.0
    # How often the feature pass's greedy token equals the engine's generated one (1.0: both run the
    # same model the same way; anything less means the labels and the engine disagree).
    engine_agreement: float = 1.0


@dataclass(frozen=True)
class TrainSettings:
    steps: int = DEFAULT_STEPS
    batch_size: int = DEFAULT_BATCH_SIZE
    depth: int = DEFAULT_DEPTH
    lr: float = DEFAULT_LR
    feature_weight: float = 1.0  # smooth L1 to f_p
    ce_weight: float = 1.0  # cross-entropy against the target's next token
    soft_targets: bool = False  # against the target's softmax (EAGLE's) rather than its greedy token
    logit_scale: float | None = None  # None: sharpness / std of the target's logits
    sharpness: float = 3.0
    full_vocab_max: int = 8192  # bigger vocabularies: cross-entropy over candidate columns
    candidate_top_k: int = 8
    identity_init: bool = True  # fc starts as "next feature = previous feature"
    prompt_weight: float = 1.0  # loss weight of prompt positions (generated ones: 1)
    val_fraction: float = 0.125  # sequences held out to pick the best checkpoint
    eval_every: int | None = None  # steps between validations (None: a tenth of the steps)
    patience: int | None = 4  # past a third of the steps, stop after this many validations without a new
    # best (None: never)
    seed: int = 0

    def check(self) -> None:
        for name in ("steps", "batch_size", "depth", "candidate_top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")


def make_distill_data(target_dir: str | os.PathLike[str], target: LlamaFamilyForCausalLM, *, num_sequences: int,
                      seq_len: int, gen_tokens: int, seed: int,
                      log: Callable[[str], None] | None = None) -> DistillData:
    """Corpus prompts (train split) + the target's greedy continuations, and the target's features and
    labels over them."""
    from kvreuse.tokenizer import Tokenizer

    for name, value, low in (("seq_len", seq_len, 2), ("gen_tokens", gen_tokens, 1),
                             ("num_sequences", num_sequences, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if gen_tokens >= seq_len:
        raise ValueError(f"gen_tokens ({gen_tokens}) must be below seq_len ({seq_len}): prompts need tokens")
    say = log or (lambda line: None)
    started = time.perf_counter()
    prompts = corpus_prompts(Tokenizer(resolve_tokenizer_path(target_dir)), num_sequences, seq_len - gen_tokens,
                             seed, "train")
    say(f"distill-eagle: {num_sequences} prompts of {seq_len - gen_tokens} corpus tokens, "
        f"each with the target's greedy continuation of {gen_tokens} tokens")
    sequences = torch.tensor(greedy_sequences(target_dir, prompts, gen_tokens), dtype=torch.long)
    generated = time.perf_counter()
    features, labels = target_features(target, sequences)
    featured = time.perf_counter()
    say(f"distill-eagle: target features for {sequences.numel()} tokens ({generated - started:.0f}s generating, "
        f"{featured - generated:.0f}s features)")
    prompt_len = seq_len - gen_tokens
    agreement = float((labels[:, prompt_len - 1:-1] == sequences[:, prompt_len:]).float().mean())
    if agreement < 0.99:
        say(f"distill-eagle: warning: the feature pass agrees with the engine's greedy tokens at only "
            f"{agreement:.1%} of the generated positions")
    return DistillData(sequences, features, labels, prompt_len, generated - started, featured - generated, agreement)


def expected_accepted(agreement: list[float]) -> float:
    """Expected accepted tokens per draft from per-depth top-1 agreement (each conditioned on the tokens
    before it being right): a0 + a0 a1 + a0 a1 a2 + ..."""
    total, running = 0.0, 1.0
    for rate in agreement:
        running *= rate
        total += running
    return total


def _start_as_identity(draft: EagleDraft, hidden: int) -> None:
    """The draft starts as a copy of its input feature (next feature = f_{p-1}): its residual branches closed."""
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, hidden:] = torch.eye(hidden)
        draft.o_proj.weight.zero_()
        draft.mlp.down_proj.weight.zero_()


def _loss_vocabulary(target: LlamaFamilyForCausalLM, weight: torch.Tensor, features: torch.Tensor,
                     labels: torch.Tensor, settings: TrainSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels and head rows the cross-entropy runs over: the whole vocabulary up to ``full_vocab_max``,
    above it the target's likely candidates only (labels outside them -1, ignored)."""
    vocab = target.config.vocab_size
    if vocab <= settings.full_vocab_max:
        return labels, weight
    candidates = candidate_vocabulary(target, features, labels, settings.candidate_top_k)
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[candidates] = torch.arange(candidates.numel())
    return index[labels], weight[candidates]


def _optimizer(parameters: list[torch.nn.Parameter], settings: TrainSettings
               ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no decay on vectors) under a linear warm-up and a cosine decay to a tenth."""
    optimizer = torch.optim.AdamW([{"params": [p for p in parameters if p.dim() >= 2], "weight_decay": 0.01},
                                   {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=settings.lr, betas=(0.9, 0.95))
    steps = settings.steps
    warmup = max(1, min(20, steps // 10))

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def _chain_loss(draft: EagleDraft, sequences: torch.Tensor, feats: torch.Tensor, targets: torch.Tensor,
                head: torch.Tensor, scale: float, position_weight: torch.Tensor, depth_weights: list[float],
                settings: TrainSettings) -> torch.Tensor:
    """One batch's loss over the draft's chained predictions, depth by depth: the feature regression (smooth
    L1) plus the cross-entropy of its logits against the target's tokens (or its soft distribution), each
    position weighted (the prompt less), deeper links weighted less."""
    hidden = feats.shape[-1]
    loss = torch.zeros(())
    for d, rows in enumerate(_chained_forward(draft, sequences, feats, settings.depth)):
        rows_d = rows[:, d:]  # the depth-d entry at p needs p >= d (its chain starts at p - d)
        weights = position_weight[d:].expand(rows_d.shape[0], -1).reshape(-1)
        per_position = settings.feature_weight * F.smooth_l1_loss(
            rows_d, feats[:, d:], reduction="none").mean(-1).reshape(-1)
        if settings.ce_weight:
            logits = F.linear(rows_d.reshape(-1, hidden), head) * scale
            if settings.soft_targets:
                with torch.no_grad():
                    wanted = F.softmax(F.linear(feats[:, d:].reshape(-1, hidden), head) * scale, dim=-1)
                ce = -(wanted * F.log_softmax(logits, dim=-1)).sum(-1)
            else:
                ce = F.cross_entropy(logits, targets[:, d:].reshape(-1), ignore_index=-1, reduction="none")
            per_position = per_position + settings.ce_weight * ce
        per_position = per_position * weights
        loss = loss + depth_weights[d] * per_position.sum() / weights.sum()
    return loss / sum(depth_weights)


def train_draft(target: LlamaFamilyForCausalLM, config: dict, data: DistillData, settings: TrainSettings,
                log: Callable[[str], None] | None = None) -> tuple[EagleDraft, dict[str, Any]]:
    """Train a fresh EAGLE-1 draft (``config``: the draft's config.json) on ``data``; returns it (float32,
    the checkpoint that did best on the validation sequences) and the figures."""
    settings.check()
    say = log or (lambda line: None)
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    count = data.sequences.shape[0]
    num_val = min(count - 1, round(count * settings.val_fraction)) if settings.val_fraction > 0 else 0
    train_rows, val_rows = slice(0, count - num_val), slice(count - num_val, count)
    sequences, features, labels = data.sequences[train_rows], data.features[train_rows], data.labels[train_rows]
    vocab = target.config.vocab_size
    hidden = features.shape[-1]
    draft = _new_draft(target, config, settings.seed, Path("."))
    if settings.identity_init:
        _start_as_identity(draft, hidden)
    weight = _lm_weight(draft)
    loss_labels, head = _loss_vocabulary(target, weight, features, labels, settings)
    scale = settings.logit_scale
    if scale is None:
        with torch.no_grad():
            scale = settings.sharpness / float(F.linear(features.reshape(-1, hidden)[:2048], weight).std())
    say(f"distill-eagle: cross-entropy over {head.shape[0]} of {vocab} vocabulary columns, logit scale {scale:.2f}; "
        f"{sequences.shape[0]} training and {num_val} validation sequences")
    position_weight = torch.ones(sequences.shape[1])
    position_weight[:data.prompt_len] = settings.prompt_weight

    parameters = [parameter for parameter in draft.parameters() if parameter.requires_grad]
    steps = settings.steps
    optimizer, scheduler = _optimizer(parameters, settings)

    def validate() -> tuple[float, list[float]]:
        draft.eval()
        agreement = top1_agreement(draft, data.sequences[val_rows], data.features[val_rows], data.labels[val_rows],
                                   settings.depth, first=data.prompt_len)
        draft.train()
        return expected_accepted(agreement), agreement

    generator = torch.Generator().manual_seed(settings.seed)
    depth_weights = [0.8 ** d for d in range(settings.depth)]
    batch_size = min(settings.batch_size, sequences.shape[0])
    losses: list[float] = []
    every = max(1, steps // 10)
    eval_every = settings.eval_every or every
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None
    if num_val:
        score, agreement = validate()
        best = (score, 0, {name: value.clone() for name, value in draft.state_dict().items()})
        say("distill-eagle: step 0 validation top-1 " + " / ".join(f"{a:.1%}" for a in agreement))
    draft.train()
    stale = 0
    for step in range(steps):
        batch = torch.randint(0, sequences.shape[0], (batch_size,), generator=generator)
        loss = _chain_loss(draft, sequences[batch], features[batch], loss_labels[batch], head, scale,
                           position_weight, depth_weights, settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        line = ""
        if (step + 1) % every == 0 or step + 1 == steps:
            recent = losses[-every:]
            line = f"distill-eagle: step {step + 1}/{steps} loss {sum(recent) / len(recent):.4f}"
        if num_val and ((step + 1) % eval_every == 0 or step + 1 == steps):
            score, agreement = validate()
            if best is None or score > best[0]:
                best = (score, step + 1, {name: value.clone() for name, value in draft.state_dict().items()})
                stale = 0
            else:
                stale += 1
            line = (line or f"distill-eagle: step {step + 1}/{steps}") + \
                " validation top-1 " + " / ".join(f"{a:.1%}" for a in agreement)
        if line:
            say(f"{line} ({time.perf_counter() - started:.0f}s)")
        if settings.patience is not None and stale >= settings.patience and step + 1 >= steps // 3:
            say(f"distill-eagle: stopping at step {step + 1}: no better validation for {stale} evaluations")
            break
    trained = time.perf_counter()
    best_step = steps
    if best is not None:
        best_step = best[1]
        draft.load_state_dict(best[2])
    draft.eval()
    shown = slice(0, min(sequences.shape[0], 32))  # a sample keeps this cheap for big vocabularies
    agreement = top1_agreement(draft, sequences[shown], features[shown], labels[shown], settings.depth)
    val_agreement = validate()[1] if num_val else []
    tail = losses[-every:]
    return draft, {
        "steps": steps,
        "steps_run": len(losses),
        "best_step": best_step,
        "depth": settings.depth,
        "loss_vocab": int(head.shape[0]),
        "final_loss": sum(tail) / len(tail),
        "train_top1": agreement[0],
        "train_top1_per_depth": agreement,
        "val_top1_per_depth": val_agreement,
        "train_seconds": trained - started,
    }


def target_hf_config(target_path: Path) -> dict[str, Any]:
    """The target's config.json as a dict: a model folder's, or the one a GGUF file's metadata gives."""
    if is_gguf_path(target_path):
        if not target_path.is_file():
            raise ValueError(f"target GGUF file {str(target_path)!r} does not exist")
        return dict(read_gguf(target_path).hf_config)
    if not (target_path / "config.json").is_file():
        raise ValueError(f"target {str(target_path)!r} is not a model folder (no config.json) or a GGUF file")
    return json.loads((target_path / "config.json").read_text(encoding="utf-8"))


def distill_eagle_draft(
    target_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    steps: int = DEFAULT_STEPS,
    seq_len: int = DEFAULT_SEQ_LEN,
    gen_tokens: int = DEFAULT_GEN_TOKENS,
    num_sequences: int = DEFAULT_NUM_SEQUENCES,
    batch_size: int = DEFAULT_BATCH_SIZE,
    depth: int = DEFAULT_DEPTH,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
    **settings: Any,
) -> dict[str, Any]:
    """Train an EAGLE-1 draft for the model in ``target_dir`` and write it to ``out_dir`` (config.json and
    model.safetensors in the target's dtype), ready for ``speculative_config={"method": "eagle",
    "model": out_dir, ...}``.

    ``num_sequences`` sequences of ``seq_len`` tokens: ``seq_len - gen_tokens`` corpus tokens and the
    target's ``gen_tokens``-token greedy continuation. ``steps`` AdamW steps of ``batch_size``
    sequences, ``depth`` chained draft steps each; further ``TrainSettings`` fields by keyword.
    Returns the figures: final loss, train-set top-1 agreement (per chained depth), tokens, seconds
    per phase and in all.
    """
    train_settings = TrainSettings(steps=steps, batch_size=batch_size, depth=depth, lr=lr, seed=seed, **settings)
    train_settings.check()
    target_path = Path(target_dir)
    started, cpu_started = time.perf_counter(), time.process_time()
    target_config = target_hf_config(target_path)
    save_dtype = _DTYPES.get(str(target_config.get("torch_dtype") or "float32"), torch.float32)
    config = draft_config(target_config, "eagle")
    # Float weights (a GGUF file's blocks dequantized): training differentiates through the frozen head.
    target, _ = load_model(target_path, torch.float32, "cpu", quantization="none")
    data = make_distill_data(target_path, target, num_sequences=num_sequences, seq_len=seq_len,
                             gen_tokens=gen_tokens, seed=seed, log=log)
    draft, figures = train_draft(target, config, data, train_settings, log)
    out_path = write_draft(out_dir, config, draft_tensors(draft, save_dtype))
    figures = {"out_dir": str(out_path), "sequences": int(data.sequences.shape[0]),
               "tokens": int(data.sequences.numel()), **figures,
               "engine_agreement": data.engine_agreement,
               "generate_seconds": data.generate_seconds, "features_seconds": data.features_seconds,
               "seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu_started}
    if log is not None:
        log(f"distill-eagle: wrote {out_path} in {figures['seconds']:.0f}s: final loss {figures['final_loss']:.4f}, "
            "train top-1 agreement " + " / ".join(f"{a:.1%}" for a in figures["train_top1_per_depth"])
            + " (first / further chained drafts)")
    return figures


def evaluate_draft(target_dir: str | os.PathLike[str], draft_dir: str | os.PathLike[str],
                   num_speculative_tokens: int | Sequence[int] = (1, 2, 4), *, num_prompts: int = 16,
                   prompt_len: int = 64, max_tokens: int = 64, seed: int = 1) -> list[dict[str, Any]]:
    """Greedy generation (EOS ignored) on held-out corpus prompts without the draft, then with it for each
    ``num_speculative_tokens``: per k the acceptance rate, the mean acceptance length (1 + accepted
    tokens per draft), accepted tokens per position and whether the outputs match token for token."""
    from kvreuse.llm import LLM
    from kvreuse.sampling import SamplingParams
    from kvreuse.tokenizer import Tokenizer

    ks = [num_speculative_tokens] if isinstance(num_speculative_tokens, int) else list(num_speculative_tokens)
    prompts = corpus_prompts(Tokenizer(resolve_tokenizer_path(target_dir)), num_prompts, prompt_len, seed, "heldout")
    inputs = [{"prompt_token_ids": prompt} for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    memory = _kv_memory(target_dir, prompts, max_tokens + 32)
    plain = [output.outputs[0].token_ids for output in LLM(
        str(target_dir), dtype="float32", quantization="none", kv_cache_memory=memory).generate(
            inputs, params, use_tqdm=False)]
    results = []
    for k in ks:
        llm = LLM(str(target_dir), dtype="float32", quantization="none", kv_cache_memory=memory, speculative_config={
            "method": "eagle", "model": str(draft_dir), "num_speculative_tokens": k})
        started = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        stats = llm.stats()
        results.append({
            "num_speculative_tokens": k,
            "acceptance_rate": stats["spec_decode_acceptance_rate"],
            "mean_acceptance_length": stats["spec_decode_mean_acceptance_length"],
            "accepted_per_position": stats["spec_decode_num_accepted_tokens_per_pos"],
            "num_drafts": stats["spec_decode_num_drafts"],
            "outputs_match": [output.outputs[0].token_ids for output in outputs] == plain,
            "seconds": seconds,
        })
        del llm
    return results


# --- kvreuse distill-eagle ------------------------------------------------------------------------------
def add_distill_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvreuse distill-eagle TARGET_DIR OUT_DIR``."""
    parser.add_argument("target", help="the target model: a folder (e.g. made by kvreuse make-model) or a GGUF file")
    parser.add_argument("out", help="the draft folder to write (created if missing)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"AdamW steps (default {DEFAULT_STEPS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                        help=f"tokens per training sequence, prompt + continuation (default {DEFAULT_SEQ_LEN})")
    parser.add_argument("--gen-tokens", type=int, default=DEFAULT_GEN_TOKENS,
                        help=f"of which the target's greedy continuation (default {DEFAULT_GEN_TOKENS})")
    parser.add_argument("--num-sequences", type=int, default=DEFAULT_NUM_SEQUENCES,
                        help=f"training sequences (default {DEFAULT_NUM_SEQUENCES})")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                        help=f"sequences per step (default {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--depth", type=int, default=DEFAULT_DEPTH,
                        help=f"chained draft steps trained per position (default {DEFAULT_DEPTH})")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"peak learning rate (default {DEFAULT_LR})")
    parser.add_argument("--evaluate", default="", metavar="K[,K...]",
                        help="afterwards, measure the acceptance rate on held-out corpus prompts with these "
                             "num_speculative_tokens (e.g. 1,2,4)")


def run_distill(args: argparse.Namespace) -> int:
    """Distil the draft ``args`` describe and print the figures; returns the exit status."""
    try:
        ks = [int(k) for k in args.evaluate.split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"--evaluate takes comma-separated integers, got {args.evaluate!r}") from None
    figures = distill_eagle_draft(args.target, args.out, steps=args.steps, seq_len=args.seq_len,
                                  gen_tokens=args.gen_tokens, num_sequences=args.num_sequences,
                                  batch_size=args.batch_size, depth=args.depth, lr=args.lr, seed=args.seed)
    for key, value in figures.items():
        shown = [round(v, 4) for v in value] if isinstance(value, list) else value
        print(f"  {key}: {round(shown, 4) if isinstance(shown, float) else shown}")
    for result in evaluate_draft(args.target, args.out, ks) if ks else []:
        print(f"num_speculative_tokens={result['num_speculative_tokens']}: acceptance rate "
              f"{result['acceptance_rate']:.1%}, mean acceptance length {result['mean_acceptance_length']:.2f}, "
              f"per position {result['accepted_per_position']}, "
              f"outputs match: {result['outputs_match']}")
    print(f'use it: speculative_config={{"method": "eagle", "model": "{args.out}", "num_speculative_tokens": 2}}')
    return 0
