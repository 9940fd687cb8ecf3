"""Test helpers: tiny random-weight Hugging Face models, their reference outputs, and a mini scheduler."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedserve.engine.messages import BatchPlan, CachedRequestData, NewRequestData, SequenceId, StepResult
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.attention import build_attention_metadata, compute_positions
from pagedserve.engine.attention.step import StepAttention
from pagedserve.engine.kv_cache import KVCache, KVCacheSpec

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
# Per-architecture tiny configs (default: TINY): the same widths in each one's own config fields.
# Qwen3's head_dim (24) is not hidden/heads (16).
TINY_BY_ARCH = {
    "qwen3": {**TINY, "head_dim": 24},
    "gpt2": dict(vocab_size=96, n_embd=64, n_inner=96, n_layer=2, n_head=4, n_positions=256,
                 layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None),
    "gpt_neox": dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=256, layer_norm_eps=1e-5, rotary_pct=0.25, tie_word_embeddings=False),
    "falcon": dict(vocab_size=96, hidden_size=64, ffn_hidden_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_kv_heads=2, new_decoder_architecture=True, max_position_embeddings=256,
                   layer_norm_epsilon=1e-5, bias=True),
}
_NORM_WEIGHTS = ("norm.weight", "ln_attn.weight", "ln_mlp.weight", "ln_f.weight")
_EMBEDDINGS = ("embed_tokens", "embed_in", "word_embeddings", ".wte.")


def _classes(arch: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM),
        "falcon": (tf.FalconConfig, tf.FalconForCausalLM),
    }[arch]


# Mixtral: 4 experts of width 48, top-2 (transformers' save_pretrained writes the per-expert
# block_sparse_moe.experts.E.w1/w2/w3 layout, though it holds fused [E, 2I, H] tensors in memory).
TINY_MIXTRAL = dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)


def _is_norm_weight(name: str) -> bool:
    return name.endswith("norm.weight") or (".ln_" in name and name.endswith(".weight"))


def save_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Saves a tiny ``arch`` model with random weights (biases and norms included) to ``folder``."""
    config_cls, model_cls = _classes(arch)
    config = config_cls(**{**TINY_BY_ARCH.get(arch, TINY), **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _is_norm_weight(name) or name.endswith(_NORM_WEIGHTS):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif any(e in name for e in _EMBEDDINGS):
                param.normal_(0.0, 1.0)
            elif ".wpe." in name:
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.15)
    model.generation_config.eos_token_id = None  # greedy references run their full length
    model.save_pretrained(folder)
    return folder


def save_tiny_tokenizer(folder: Path, vocab_size: int = 96) -> Path:
    """Writes a word-level tokenizer (``t0`` ... ``t{vocab_size-1}``) to ``folder``, so that
    :class:`pagedserve.llm.LLM` can open a tiny model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(folder)
    return folder


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Full-sequence logits ``[T, vocab]`` of a Hugging Face model."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Hugging Face greedy ``generate`` of exactly ``num_tokens`` tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def relative_errors(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``||a-b|| / ||b||`` and ``max|a-b| / max|b|``."""
    diff = ours - ref
    return float(diff.norm() / ref.norm()), float(diff.abs().max() / ref.abs().max())


def rewrite_config(folder: Path, **changes) -> None:
    """Edits ``config.json`` in place (a value of ``None`` deletes the key)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def make_cache(model, num_blocks: int, block_size: int, device: str = "cpu") -> KVCache:
    c = model.config
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, block_size, model.dtype)
    return KVCache(spec, num_blocks, device)


def forward_step(model, cache: KVCache, backend, token_ids: list[list[int]], context_lens: list[int],
                 block_tables: list[list[int]], forward=None) -> torch.Tensor:
    """One forward pass of our model (or of ``forward``, e.g. a compiled one) over several sequences'
    new tokens; logits of every token ``[T, V]``, on the cache's device."""
    device = cache.key_caches[0].device
    query_lens = [len(t) for t in token_ids]
    positions = compute_positions(query_lens, context_lens)  # the metadata is built from it on the CPU
    metadata = build_attention_metadata(query_lens, context_lens, block_tables, positions, cache.block_size,
                                        device=device)
    ids = torch.tensor([t for seq in token_ids for t in seq], device=device)
    with torch.inference_mode():
        return model.compute_logits((forward or model)(ids, positions.to(device), StepAttention(cache, metadata,
                                                                                               backend)))


GREEDY = EngineSamplingParams(max_tokens=64, temperature=0.0)


@dataclass
class _Req:
    tokens: list[int]
    num_prompt: int
    params: EngineSamplingParams
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent: bool = False


class MiniScheduler:
    """Drives a ModelRunner with hand-written schedules, doing the block bookkeeping a scheduler does.

    Blocks come from a shuffled free list, so block tables are never contiguous.
    """

    def __init__(self, runner, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}
        self.step_id = 0
        self.pending_finished: list[str] = []

    def add(self, rid: str, prompt: list[int], params: EngineSamplingParams = GREEDY) -> None:
        self.reqs[rid] = _Req(list(prompt), len(prompt), params)

    def outputs(self, rid: str) -> list[int]:
        r = self.reqs[rid]
        return r.tokens[r.num_prompt:]

    def preempt(self, rid: str) -> None:
        """Recompute-preemption: free its blocks; it is re-sent in full next time it is scheduled."""
        r = self.reqs[rid]
        self.free += r.blocks
        r.blocks, r.computed, r.sent = [], 0, False
        self.pending_finished.append(rid)

    def remaining(self, rid: str) -> int:
        r = self.reqs[rid]
        return len(r.tokens) - r.computed

    def plan(self, schedule: dict[str, int]) -> BatchPlan:
        new, cached = [], []
        for rid, n in schedule.items():
            r = self.reqs[rid]
            need = -(-(r.computed + n) // self.block_size) - len(r.blocks)
            added = [self.free.pop() for _ in range(max(need, 0))]
            r.blocks += added
            if r.sent:
                cached.append(CachedRequestData(SequenceId(rid), tuple(added), r.computed, n))
            else:
                new.append(NewRequestData(SequenceId(rid), tuple(r.tokens), r.num_prompt, tuple(r.blocks), r.computed, n,
                                          r.params))
        self.step_id += 1
        finished, self.pending_finished = tuple(SequenceId(r) for r in self.pending_finished), []
        return BatchPlan(self.step_id, tuple(new), tuple(cached), finished)

    def step(self, schedule: dict[str, int]) -> StepResult:
        """Executes one step; ``schedule`` maps request id -> tokens to compute (0 or ``-1``: all remaining)."""
        schedule = {rid: (self.remaining(rid) if n < 0 else n) for rid, n in schedule.items()}
        result = self.runner.execute(self.plan(schedule))
        for rid, n in schedule.items():
            self.reqs[rid].computed += n
            self.reqs[rid].sent = True
        for s in result.sampled:
            self.reqs[s.request_id].tokens.append(s.token_id)
        return result
