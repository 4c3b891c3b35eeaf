"""The per-step tables every KVarN metadata builder makes (dense and MLA layers alike).

vLLM gives a step's requests as batch rows and their pages as block-table rows; KVarN's ops index a
request's current tile and pages by its slot (``slots.RequestSlots``). So each step, each row's slot and
start position are written into persistent buffers, and each row's block-table row is copied to its
slot's row of the page table. The buffers keep their addresses from step to step, so that full CUDA
graphs replay with fresh values.

Shape legend: S = max_num_seqs + 1 slots, B rows in the step, W block-table width.

    slots       int32 [B]     each row's slot (a view of a persistent buffer)
    start_pos   int32 [B]     tokens cached for each row before this step
    page_table  int32 [S, W]  vLLM's block-table rows, moved to the rows' slots
    seq_lens    int32 [S]     tokens each slot's cache holds (the appends write it)
"""

from __future__ import annotations

import torch

from .slots import request_slots


class StepRows:
    def __init__(self, vllm_config, device: torch.device):
        self.slots = request_slots(vllm_config.scheduler_config.max_num_seqs)
        self.device = device
        self.seq_lens = torch.zeros(self.slots.num_slots, dtype=torch.int32, device=device)
        # batch rows: real requests (<= max_num_seqs) or the rows of a captured CUDA graph
        rows = max(self.slots.num_slots, getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0)
        self.row_slots = torch.zeros(rows, dtype=torch.int32, device=device)
        self.start_pos = torch.zeros(rows, dtype=torch.int32, device=device)
        self.page_table: torch.Tensor | None = None

    def update(self, m) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots [B], start_pos [B], page_table [S, W]) for the step of ``m`` (vLLM's
        ``CommonAttentionMetadata``)."""
        b = m.num_reqs
        qsl = m.query_start_loc[: b + 1]
        torch.sub(m.seq_lens[:b], qsl[1:] - qsl[:-1], out=self.start_pos[:b])
        slots = self.row_slots[:b]
        slots.copy_(torch.tensor(self.slots.rows(b), dtype=torch.int32))  # blocking: the host list is reused
        blocks = m.block_table_tensor[:b]
        if self.page_table is None or self.page_table.shape[1] != blocks.shape[1]:
            self.page_table = torch.zeros(self.slots.num_slots, blocks.shape[1], dtype=torch.int32, device=self.device)
        self.page_table.index_copy_(0, slots.long(), blocks.to(torch.int32))
        return slots, self.start_pos[:b], self.page_table
