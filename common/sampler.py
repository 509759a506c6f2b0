"""The sampler every step shares: one token per row of logits, and its logprobs when asked.

The engine hands it the round's rows of logits and, for each, a ``SamplingState``: how the
request samples, what it has read and written so far, which ids would end it. The steps follow
vLLM's ``Sampler`` (``vllm/v1/sample/sampler.py``) in vLLM's order:

1. the raw logprobs of the rows that ask: log_softmax of the model's own logits, before
   anything below changes them (vLLM's default ``logprobs_mode``, "raw_logprobs");
2. ``min_tokens``: until a request has that many tokens, its eos and stop ids get -inf
   (vLLM's ``MinTokensLogitsProcessor``);
3. the penalties: repetition over the prompt and the output, then frequency and presence over
   the output (vLLM's ``apply_penalties``): greedy requests too, since they change the argmax;
4. greedy rows take the argmax here; drawn rows go on;
5. the temperature, then ``min_p`` (vLLM applies it here, after the temperature and before
   top-k and top-p; Hugging Face's warpers apply it after top-p, and since top-p adds up the
   probabilities that ``min_p`` leaves, the order changes what is kept), then top-k, then
   top-p, in Hugging Face's way for those two;
6. the draw, an exponential race with the row's own generator.

Each of 1, 2, 3 and ``min_p`` touches only the rows that ask for it: a request with every
default goes through the argmax, or the filters and the race, as before they existed.

The draw is what makes this engine's sampling special: the k-th token of a request is drawn with
a generator seeded by (the request's seed, k) and nothing else. No generator is shared between
requests or carried from round to round, so batching, preemption (a resumed request recomputes
its KV but never draws a token again) and the prefix cache cannot change which token comes out:
every step samples the same tokens, and the suite checks it as it checks greedy decoding. The
penalties read only the request's own tokens, so they keep that promise.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .sampling_params import MAX_SEED, SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class SamplingState:
    """One request as the sampler sees it at its next draw (vLLM keeps the same per request in
    its input batch, ``CachedRequestState``, and hands it over batched as ``SamplingMetadata``).

    The lists are the request's own, read and not copied: build one per draw.
    """

    params: SamplingParams
    prompt_ids: Sequence[int]  # what repetition_penalty reads, with the output
    output_ids: Sequence[int]  # the tokens generated so far: the penalties' counts
    stop_ids: frozenset[int] = frozenset()  # eos and stop ids: what min_tokens holds back

    @classmethod
    def of(cls, seq: Any) -> SamplingState:
        """The state of an engine's sequence (any step's ``Sequence``) at its next draw."""
        return cls(seq.sampling_params, seq.prompt_ids, seq.generated_ids, seq.eos_token_ids)

    @property
    def num_drawn(self) -> int:
        """k: the index of the token drawn now (0 for the first), which seeds the draw."""
        return len(self.output_ids)

    @property
    def holds_back_stop_ids(self) -> bool:
        return self.num_drawn < self.params.min_tokens and bool(self.stop_ids)


@dataclass(frozen=True)
class SamplerOutput:
    """What ``sample`` gives for the round's rows (vLLM's ``SamplerOutput``)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request did not ask


def sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
    """One token per row of ``logits`` [rows, vocab]: row i belongs to the request of
    ``states[i]``, and the token is its ``states[i].num_drawn``-th.

    Greedy rows take the argmax. The others are drawn by an exponential race (vLLM's way):
    token i wins ``argmax(p_i / E_i)`` with E_i ~ Exp(1), which happens with probability p_i
    exactly. The E_i come from the row's own generator, on the CPU, so a GPU run draws the same.
    """
    processed = apply_min_tokens_and_penalties(logits, states)
    tokens = processed.argmax(dim=-1)
    drawn = [i for i, s in enumerate(states) if not s.params.greedy]
    if drawn:
        params = [states[i].params for i in drawn]
        probs = filter_logits(processed[drawn], params).softmax(dim=-1)
        vocab = probs.shape[-1]
        race = torch.stack(
            [exponentials(states[i].params.seed, states[i].num_drawn, vocab) for i in drawn]
        ).to(probs.device)
        tokens[drawn] = (probs / race).argmax(dim=-1).to(tokens.dtype)
    token_ids = tokens.tolist()
    return SamplerOutput(token_ids, sampled_logprobs(logits, token_ids, states))


# ---- before the argmax: min_tokens and the penalties ----------------------------------------


def apply_min_tokens_and_penalties(
    logits: torch.Tensor, states: Sequence[SamplingState]
) -> torch.Tensor:
    """The rows whose request holds back its stop ids or has a penalty, changed; the others as
    they are. No row asks (the usual case): ``logits`` itself, untouched and not copied."""
    rows = [i for i, s in enumerate(states) if s.holds_back_stop_ids or s.params.has_penalties]
    if not rows:
        return logits
    logits = logits.to(wide_dtype(logits.dtype), copy=True)  # the raw logits stay for logprobs
    for i in rows:
        logits[i] = penalized_row(logits[i], states[i])
    return logits


def penalized_row(row: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """One request's row of logits after ``min_tokens`` and the penalties, in vLLM's order."""
    params, vocab = state.params, row.shape[-1]
    row = row.clone()
    if state.holds_back_stop_ids:
        row[sorted(state.stop_ids)] = -math.inf
    output_counts = token_counts(state.output_ids, vocab, row.device)
    if params.repetition_penalty != 1:
        seen = (token_counts(state.prompt_ids, vocab, row.device) > 0) | (output_counts > 0)
        penalty = params.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row)
    if params.frequency_penalty or params.presence_penalty:
        row = row - params.frequency_penalty * output_counts.to(row.dtype)
        row = row - params.presence_penalty * (output_counts > 0).to(row.dtype)
    return row


def token_counts(token_ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each id of the vocabulary occurs in ``token_ids``: ``[vocab]``."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
    return torch.bincount(ids, minlength=vocab)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or the logits' own dtype when it is wider (float64 keeps its precision)."""
    return torch.promote_types(dtype, torch.float32)


# ---- the filters of a drawn row ---------------------------------------------------------------


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The filters of the drawn rows, one row per request: divide by the temperature, drop what
    ``min_p`` drops, then keep the top-k, then the top-p (the last two are Hugging Face's
    warpers); a token filtered out gets -inf. Rows are independent, so a row gives the same
    numbers alone or in a batch."""
    logits = logits.float()
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature[:, None]
    if any(p.min_p for p in params):
        logits = apply_min_p(logits, [p.min_p for p in params])
    # top-k: every token at least as likely as the k-th (ties at the k-th all stay)
    k = torch.tensor([p.top_k or vocab for p in params], device=logits.device).clamp(max=vocab)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    logits = logits.masked_fill(logits < kth, -math.inf)
    # top-p: drop the least likely tokens while what they add up to is at most 1 - top_p
    ascending, order = logits.sort(dim=-1)
    tail = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = tail <= torch.tensor([1 - p.top_p for p in params], device=logits.device)[:, None]
    drop[:, -1] = False  # the most likely token always stays
    return logits.masked_fill(drop.scatter(1, order, drop), -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop every token whose probability is below ``min_p`` times the most likely one's (vLLM's
    rule; a token exactly at the threshold stays, and the most likely always does). A row with
    ``min_p`` 0 keeps everything."""
    probs = logits.softmax(dim=-1)
    scale = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None]
    threshold = scale * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, -math.inf)


# ---- the draw -----------------------------------------------------------------------------------


def draw_generator(seed: int, k: int) -> torch.Generator:
    """The generator of a request's k-th draw: seeded by (seed, k) alone. A hash, so that
    (seed 1, token 0) and (seed 0, token 1) do not share their numbers."""
    digest = hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") % MAX_SEED)


def exponentials(seed: int | None, k: int, vocab: int) -> torch.Tensor:
    """``vocab`` draws of Exp(1) for a request's k-th token, never 0 (p / 0 would win)."""
    if seed is None:
        raise ValueError("a sampled request needs a seed (the engine gives one: with_seed)")
    race = torch.empty(vocab).exponential_(generator=draw_generator(seed, k))
    return race.clamp_min_(torch.finfo(race.dtype).tiny)


# ---- logprobs -----------------------------------------------------------------------------------


def sampled_logprobs(
    logits: torch.Tensor, token_ids: list[int], states: Sequence[SamplingState]
) -> list[TokenLogprobs | None]:
    """The raw logprobs of each row's token, for the rows whose request asks; None elsewhere."""
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    found: list[TokenLogprobs | None] = [None] * len(states)
    if rows:
        num_top = [states[i].params.logprobs for i in rows]
        chosen = [token_ids[i] for i in rows]
        for i, entry in zip(rows, token_logprobs(logits[rows], chosen, num_top)):
            found[i] = entry
    return found


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Row i: the log-probability of ``token_ids[i]`` and of the ``num_top[i]`` most likely
    tokens, from log_softmax of the row (in float32, or the logits' dtype if wider)."""
    logprobs = logits.to(wide_dtype(logits.dtype)).log_softmax(dim=-1)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
    k = min(max(num_top, default=0), logprobs.shape[-1])
    top_values, top_ids = (x.tolist() for x in logprobs.topk(k, dim=-1))  # most likely first
    return [
        TokenLogprobs(token, logprob, tuple(zip(top_ids[i][:n], top_values[i][:n])))
        for i, (token, logprob, n) in enumerate(zip(token_ids, chosen, num_top))
    ]
