"""Speculative decoding on the KVarN cache: draft tokens are held back until they are accepted (no vLLM import).

With n-gram speculation a request's step carries its last sampled token (certain) and ``d`` draft tokens.
Attention covers all of them, as fresh tokens of the call. Only the certain tokens are appended to the
cache; the drafts' keys and values are staged per request slot, outside the cache. In the next step vLLM
reports how many drafts were accepted (its start position moved past them): those are appended first,
before attention, and the rest are dropped. So no tile is ever completed, and quantized, from a token that
is later rejected, and the exact current tile never needs rows it lost.

Shape legend: ``staged`` per layer [S, D_max, Hkv, D] (slot, draft index); a plan's lists index tokens
of the step ([T] rows of q/k/v) and staged rows. ``plan_step`` is plain Python (run on the host once per
step); ``CatchUp`` and ``SpeculativeStep`` are a plan's device index tensors, read by every layer.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch


@dataclasses.dataclass(frozen=True)
class Row:
    """One request of the step: its slot, tokens in the step, drafts among them (the last ones), where
    vLLM says it starts, what the cache holds for it, and whether its slot was just assigned."""

    slot: int
    num_tokens: int
    num_drafts: int
    start: int
    committed: int
    new: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    """The host side of one step: the accepted drafts to append before attention, the step's tokens to
    append after it (per row, the ones before its drafts), and the drafts to stage for the next step."""

    catch_up: list[tuple[int, int, int]]  # (slot, count, position of the first)
    certain_tokens: list[int]
    certain_counts: list[int]
    stage: list[tuple[int, int, int]]  # (token index, slot, draft index)
    staged_after: dict[int, int]  # slot -> drafts staged once this step ran


def plan_step(rows: list[Row], staged: dict[int, int]) -> Plan:
    """Plan a step from its rows and the drafts each slot staged in the previous step (``staged``).

    Raises if vLLM's start position disagrees with what the cache holds plus the staged drafts: a
    silent mismatch would attend to the wrong tokens.
    """
    catch_up, certain, counts, stage = [], [], [], []
    after = dict(staged)
    token = 0
    for row in rows:
        held = 0 if row.new else staged.get(row.slot, 0)
        accepted = row.start - (row.start if row.new else row.committed)
        if not 0 <= accepted <= held:
            raise RuntimeError(
                f"KVarN speculative decoding: slot {row.slot} holds {row.committed} tokens and {held} staged "
                f"drafts, but vLLM continues it at position {row.start}"
            )
        if accepted:
            catch_up.append((row.slot, accepted, row.committed))
        keep = row.num_tokens - row.num_drafts
        certain.extend(range(token, token + keep))
        counts.append(keep)
        stage.extend((token + keep + j, row.slot, j) for j in range(row.num_drafts))
        after[row.slot] = row.num_drafts
        token += row.num_tokens
    return Plan(catch_up, certain, counts, stage, after)


def _tensor(values, device, dtype=torch.long) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _offsets(counts, device) -> torch.Tensor:
    return _tensor([0, *itertools.accumulate(counts)], device, torch.int32)


@dataclasses.dataclass
class CatchUp:
    """The drafts vLLM accepted since the last step, as one append per layer (``speculative.Plan.catch_up``)."""

    staged_slot: torch.Tensor  # long [P]  where each accepted draft is staged: slot ...
    staged_index: torch.Tensor  # long [P]  ... and draft index
    slots: torch.Tensor  # int32 [R]
    start_pos: torch.Tensor  # int32 [R]  tokens the cache holds for each of them
    query_start_loc: torch.Tensor  # int32 [R+1]
    max_query_len: int

    @classmethod
    def of(cls, plan: Plan, device: torch.device) -> CatchUp:
        slots, counts, starts = zip(*plan.catch_up)
        return cls(_tensor([s for s, n in zip(slots, counts) for _ in range(n)], device),
                   _tensor([j for n in counts for j in range(n)], device), _tensor(slots, device, torch.int32),
                   _tensor(starts, device, torch.int32), _offsets(counts, device), max(counts))  # fmt: skip


@dataclasses.dataclass
class SpeculativeStep:
    """The rest of a plan with draft tokens, as device index tensors read by every layer."""

    certain: torch.Tensor  # long [C]    the step's tokens to append (each row's tokens before its drafts)
    certain_qsl: torch.Tensor  # int32 [B+1]
    certain_max: int
    stage: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # token, slot, draft index: long [N] each

    @classmethod
    def of(cls, plan: Plan, device: torch.device) -> SpeculativeStep:
        return cls(_tensor(plan.certain_tokens, device), _offsets(plan.certain_counts, device),
                   max(plan.certain_counts, default=0),
                   tuple(_tensor(column, device) for column in zip(*plan.stage)))  # fmt: skip
