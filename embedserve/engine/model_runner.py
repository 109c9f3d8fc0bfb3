"""Turns a SchedulerOutput into the model's tensors (slot mappings, block tables), runs the
model, and returns the logits of the sequences that reached their last token."""

from __future__ import annotations

import torch

from ..models.llama import LlamaModel
from ..models.attention_dispatch import AttentionMetadata
from .scheduler import SchedulerOutput
from .sequence import Sequence


class ModelRunner:
    """Owns the model and the preallocated KV cache pool."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype):
        cfg = model.cfg
        self.model, self.block_size = model, block_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # one (K, V) pair per layer: [num_blocks, block_size, kv_heads, head_dim]
        self.kv_caches = [(torch.zeros(shape, dtype=kv_dtype, device=model.device),
                           torch.zeros(shape, dtype=kv_dtype, device=model.device))
                          for _ in range(cfg.num_hidden_layers)]

    def run(self, sched: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor | None]:
        """Forward the step; returns the sequences that sample now and their logits (n, V)."""
        bs = self.block_size
        # decodes (one token, caught up but for it) first: the attention path batches them
        items = sorted(sched.scheduled, key=lambda sn: sn[1] != 1)
        ids, pos, slots, ctx, qlens, cu, tables = [], [], [], [], [], [0], []
        samplers, rows = [], []
        for seq, n in items:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            p = range(start, start + n)
            pos += p
            bt = seq.block_table
            slots += [bt[i // bs] * bs + i % bs for i in p]
            ctx.append(start + n)
            qlens.append(n)
            cu.append(cu[-1] + n)
            tables.append(bt)
            if start + n == seq.num_tokens:
                samplers.append(seq)
                rows.append(cu[-1] - 1)
        dev = self.model.device
        width = max(len(t) for t in tables)
        bt_tensor = torch.full((len(tables), width), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt_tensor[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=bt_tensor.to(dev), context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            num_decodes=_leading_ones(qlens),
            context_lens_list=ctx, q_lens_list=qlens)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev),
                                    torch.tensor(pos, dtype=torch.long, device=dev), self.kv_caches, meta)
        if not samplers:
            return [], None
        return samplers, self.model.logits(hidden[torch.tensor(rows, device=dev)])


def _leading_ones(qlens: list[int]) -> int:
    n = 0
    while n < len(qlens) and qlens[n] == 1:
        n += 1
    return n
