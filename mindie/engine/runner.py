"""Turns a SchedulerOutput into the model's flat inputs and runs one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindie import ops
from mindie.engine.block_manager import BlockManager
from mindie.engine.media_step import media_rows
from mindie.engine.scheduler import SchedulerOutput
from mindie.engine.sequence import Sequence
from mindie.model.llama import AttentionMetadata, LlamaModel


@dataclass
class PromptLogits:
    seq: Sequence
    first_position: int  # logits[i] are those after prompt position first_position + i
    logits: torch.Tensor


class ModelRunner:
    def __init__(self, model: LlamaModel, blocks: BlockManager) -> None:
        self.model = model
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.kv_caches = model.allocate_kv_cache(blocks.num_blocks, blocks.block_size)

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence], list[PromptLogits]]:
        """Runs the scheduled tokens. Returns next-token logits [rows, vocab] for the sequences
        whose every token is computed after this step (mid-prefill chunks produce no row), and the
        logits of the prompt positions computed this step for sequences that want prompt
        log-probabilities."""
        if out.block_copies:  # copy-on-write before this step writes into the copies
            mapping = torch.tensor(out.block_copies, dtype=torch.int64)
            for k_cache, v_cache in self.kv_caches:
                ops.copy_blocks(k_cache, k_cache, mapping)
                ops.copy_blocks(v_cache, v_cache, mapping)
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        lens: list[int] = []
        tables: list[list[int]] = []
        prompt_lens: list[int] = []
        rows: list[int] = []
        row_seqs: list[Sequence] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Sequence, int, int]] = []  # (seq, first position, count)
        spans: list[tuple[Sequence, int, int, int]] = []  # (seq, first row, first position, count)
        for s in out.scheduled:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            table = self.blocks.block_table(seq.seq_id)
            spans.append((seq, len(ids), start, n))
            ids += seq.token_ids[start : start + n]
            pos = range(start, start + n)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            starts.append(starts[-1] + n)
            lens.append(start + n)
            tables.append(table)
            prompt_lens.append(seq.num_prompt_tokens)
            if seq.wants_prompt_logprobs:
                # position p predicts prompt token p + 1
                last = min(start + n, seq.num_prompt_tokens - 1)
                if last > start:
                    prompt_spans.append((seq, start, last - start))
                    prompt_rows += range(starts[-2], starts[-2] + last - start)
            if start + n == len(seq.token_ids):
                rows.append(starts[-1] - 1)
                row_seqs.append(seq)
        width = max(len(t) for t in tables)
        media = media_rows(self.model, spans)
        # Padding and released entries (HOLE, behind every layer's sliding window) are never read:
        # block 0 stands in for them, an id the kernels' checks accept.
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor([[max(b, 0) for b in t] + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            logits_indices=torch.tensor(rows + prompt_rows, dtype=torch.int64),
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.int32),
            media_rows=media.rows,
            media_embeds=media.embeds,
            rope_cos_sin=media.rope,
        )
        logits = self.model.forward(torch.tensor(ids, dtype=torch.int64), meta, self.kv_caches)
        prompt_logits, at = [], len(rows)
        for seq, first, count in prompt_spans:
            prompt_logits.append(PromptLogits(seq, first, logits[at : at + count]))
            at += count
        return logits[: len(rows)], row_seqs, prompt_logits
