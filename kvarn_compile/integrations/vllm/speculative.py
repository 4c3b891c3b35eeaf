"""Speculative decoding on the KVarN cache: draft tokens are held back until they are accepted (pure Python).

With n-gram speculation a request's step carries its last sampled token (certain) and ``d`` draft tokens.
Attention covers all of them, as fresh tokens of the call. Only the certain tokens are appended to the
cache; the drafts' keys and values are staged per request slot, outside the cache. In the next step vLLM
reports how many drafts were accepted (its start position moved past them): those are appended first,
before attention, and the rest are dropped. So no tile is ever completed, and quantized, from a token that
is later rejected, and the exact current tile never needs rows it lost.

Shape legend: ``staged`` per layer [S, D_max, Hkv, D] (slot, draft index); a plan's lists index tokens
of the step ([T] rows of q/k/v) and staged rows.
"""

from __future__ import annotations

import dataclasses


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
