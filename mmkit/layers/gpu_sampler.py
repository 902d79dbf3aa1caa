"""GpuSampler: the whole batch sampled on the device with one host sync per step.

Same order and semantics as `sampler.Sampler` (penalties -> min_tokens EOS mask -> greedy
argmax, or temperature -> top-k -> top-p -> min-p -> softmax -> exponential-race draw; logprobs
of the raw distribution), with three differences made for a GPU:

- no per-row tensor op or host sync: per-row parameters become device tensors in one copy
  each, every filter runs on the whole batch, the min_tokens "do not ban the only allowed
  token" rule is a `where`, and the results (token ids, logprobs, ranks, top-k) are packed
  into one tensor read back with a single `.tolist()`;
- seeded draws grouped: a row's Exp(1) noise is a counter-based hash of (its generator's
  seed, the sequence position, the token id), computed for every row in one vectorized pass.
  A seeded request therefore draws the same tokens whatever else is in the batch, without
  one RNG call per row (the CPU sampler calls each row's `torch.Generator`);
- rows without a generator share one `exponential_()` call.

The draws of a seeded request differ from the CPU sampler's (another random stream); the
distribution is the same, tested on CPU against it.
"""

from __future__ import annotations

import torch

from mmkit.layers.sampler import SamplerOutput, SamplingRow, apply_penalties

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding uint32 values (wraps like uint32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def hashed_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 Exp(1) noise, a pure function of (seed, position, token id) per row.
    seeds, positions: [rows] int64 on the target device."""
    device = seeds.device
    key = _mix32((seeds & _MASK32) ^ _mix32((seeds >> 32) & _MASK32))
    key = _mix32(key ^ ((positions * 0x9E3779B9) & _MASK32))  # [rows]
    tokens = torch.arange(vocab, dtype=torch.int64, device=device)
    bits = _mix32(key[:, None] ^ _mix32(tokens[None, :] + 0x632BE5AB))  # [rows, vocab] uint32 values
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 bits
    return -torch.log(uniform)


class GpuSampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        # logits: [num_rows, vocab] in the model dtype; sampled in float32.
        num_rows, vocab = logits.shape
        device = logits.device
        params = [r.params for r in rows]
        logits = logits.float()
        wants = [p.logprobs for p in params if p.logprobs is not None]
        raw_logprobs = logits.log_softmax(dim=-1) if wants else None
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, rows)
        if any(p.min_tokens for p in params):
            logits = _mask_min_tokens(logits, rows)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            sampled = self._draw(logits, rows, random_rows)
            is_random = torch.zeros(num_rows, dtype=torch.bool, device=device)
            is_random[random_rows] = True
            token_ids = torch.where(is_random, sampled, token_ids)
        # One packed readback: [token, (logprob, rank, top ids, top logprobs)] per row.
        k = min(max(wants), vocab) if wants else 0
        parts = [token_ids.double()[:, None]]
        if raw_logprobs is not None:
            sampled_lp = raw_logprobs.gather(1, token_ids[:, None])
            ranks = (raw_logprobs > sampled_lp).sum(dim=-1, keepdim=True) + 1
            parts += [sampled_lp.double(), ranks.double()]
            if k:
                top = raw_logprobs.topk(k, dim=-1)
                parts += [top.indices.double(), top.values.double()]
        packed = torch.cat(parts, dim=1).tolist()  # NOTE: the step's one host sync
        out = SamplerOutput(token_ids=[int(r[0]) for r in packed], logprobs=None, ranks=None, top_ids=None,
                            top_logprobs=None)
        if raw_logprobs is not None:
            out.logprobs = [r[1] for r in packed]
            out.ranks = [int(r[2]) for r in packed]
            if k:
                out.top_ids = [[int(t) for t in r[3:3 + k]] for r in packed]
                out.top_logprobs = [r[3 + k:3 + 2 * k] for r in packed]
        return out

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], random_rows: list[int]) -> torch.Tensor:
        """Draws for every row (greedy rows' results are discarded): [num_rows] int64."""
        device = logits.device
        vocab = logits.shape[-1]
        params = [r.params for r in rows]
        temperature = _tensor([p.temperature if not p.is_greedy else 1.0 for p in params], torch.float32, device)
        scaled = logits / temperature[:, None]
        if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in random_rows):
            top_k = _tensor([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, device)
            top_p = _tensor([p.top_p for p in params], torch.float32, device)
            scaled = _top_k_top_p(scaled, top_k, top_p)
        if any(params[i].min_p > 0 for i in random_rows):
            min_p = _tensor([p.min_p for p in params], torch.float32, device)
            probs = scaled.softmax(dim=-1)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            scaled = scaled.masked_fill(probs < threshold, float("-inf"))
        probs = scaled.softmax(dim=-1)
        seeded = [r.generator is not None for r in rows]
        seeds = _tensor([r.generator.initial_seed() if r.generator is not None else 0 for r in rows], torch.int64,
                        device)
        positions = _tensor([r.position for r in rows], torch.int64, device)
        noise = hashed_exponential(seeds, positions, vocab)
        if not all(seeded):
            shared = torch.empty_like(noise).exponential_()
            noise = torch.where(_tensor(seeded, torch.bool, device)[:, None], noise, shared)
        return (probs / noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`sampler.filter_logits`' top-k and top-p without its host-side checks."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p[:, None]
    remove[:, 0] = False
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(remove, float("-inf")))


def _mask_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Ban EOS and stop ids of rows below min_tokens, except where that bans every finite logit."""
    vocab = logits.shape[-1]
    row_idx, tok_idx = [], []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            ids = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(r.params.eos_token_ids))
            ids = [t for t in dict.fromkeys(ids) if t < vocab]
            row_idx.extend([i] * len(ids))
            tok_idx.extend(ids)
    if not row_idx:
        return logits
    banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    banned[_tensor(row_idx, torch.int64, logits.device), _tensor(tok_idx, torch.int64, logits.device)] = True
    keeps_some = (torch.isfinite(logits) & ~banned).any(dim=-1, keepdim=True)
    return logits.masked_fill(banned & keeps_some, float("-inf"))


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
