"""Turns a step's sequences into one flat, unpadded batch, runs the model, samples."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor_svc.attention import AttentionMetadata
from executor_svc.cache_engine import CacheEngine
from executor_svc.grammar import GrammarMasks
from executor_svc.models.layers import CausalLM
from executor_svc.parallel import Shard
from executor_svc.prompt_scorer import score_prompts
from executor_svc.sampler import Sampler
from pagedserve.step import SeqOutput, SeqStep
from pagedserve_kernels import ops


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    last_token_index: torch.Tensor  # [num_seqs], each sequence's last new token
    meta: AttentionMetadata


class ModelRunner:
    """Runs prefill and decode sequences of one step in a single forward pass."""

    def __init__(
        self,
        model: CausalLM,
        cache: CacheEngine,
        sampler: Sampler,
        device: torch.device,
        shard: Shard | None = None,
        grammars: GrammarMasks | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = device
        self.shard = shard
        self.grammars = grammars  # rank 0 only, and only with a tokenizer
        if device.type == "cpu":
            ops.cpu_extension()  # built (first time only) now rather than inside a step

    @torch.inference_mode()
    def execute(
        self, seqs: list[SeqStep], end_early: Callable[[], bool] = lambda: False
    ) -> list[SeqOutput]:
        """Compute every sequence's new tokens against its cached context and draw samples;
        a sequence with ``num_steps`` k > 1 then decodes k - 1 more tokens, batched with
        the others still going, unless ``end_early()`` (asked on rank 0 between two decode
        steps) says a request is waiting: every sequence then answers what it drew so far.

        Writes the new tokens' K/V into the KV pool. Returns outputs in input order.
        """
        outputs = self._forward(seqs)
        current = list(seqs)
        going = [i for i, seq in enumerate(seqs) if seq.num_steps > 1]
        while going:
            drawn, end = self._agreed(
                [outputs[i].token_ids[-1] if outputs[i].token_ids else 0 for i in going],
                end_early(),
            )
            if end:
                break
            for i, token_id in zip(going, drawn, strict=True):
                current[i] = current[i].advance(token_id)
            for i, more in zip(going, self._forward([current[i] for i in going]), strict=True):
                outputs[i].token_ids += more.token_ids
                outputs[i].logprobs += more.logprobs
                outputs[i].top_logprobs += more.top_logprobs
            going = [i for i in going if current[i].num_steps > 1]
        return outputs

    def _agreed(self, token_ids: list[int], end: bool) -> tuple[list[int], bool]:
        """Rank 0's draws, and whether it ends the run here, on every rank: only rank 0
        samples under tensor parallelism and hears of waiting requests."""
        if self.shard is None:
            return token_ids, end
        tensor = torch.tensor([*token_ids, int(end)], dtype=torch.long, device=self.device)
        self.shard.broadcast(tensor)
        *agreed, ended = tensor.tolist()
        return agreed, bool(ended)

    def _forward(self, seqs: list[SeqStep]) -> list[SeqOutput]:
        """One forward pass over the batch and one draw for each sequence, in input order."""
        if not seqs:
            return []
        # Prefill sequences first, then decodes (one new token each), keeping input order.
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].new_token_ids) == 1)
        ordered = [seqs[i] for i in order]
        batch = self._prepare(ordered)
        hidden = self.model(batch.input_ids, batch.positions, self.cache.gpu_cache, batch.meta)
        # A prompt chunk short of the prompt's end draws nothing: no logits for it.
        drawing = [i for i, seq in enumerate(ordered) if seq.num_samples > 0]
        outputs = [SeqOutput(seq.seq_id, [], []) for seq in seqs]
        if drawing:
            rows = batch.last_token_index[torch.tensor(drawing, device=self.device)]
            logits = self.model.compute_logits(hidden[rows])  # [num_drawing, vocab_size]
            drawn = [ordered[i] for i in drawing]
            if self.grammars is not None:
                self.grammars.mask(logits, drawn)
            sampled = self.sampler(logits, drawn)
            if self.grammars is not None:
                self.grammars.accept(drawn, sampled)
            for i, output in zip(drawing, sampled, strict=True):
                outputs[order[i]] = output
        for i, scored in score_prompts(hidden, ordered, self.model.compute_logits).items():
            outputs[order[i]].prompt_logprobs = scored
        return outputs

    def _prepare(self, seqs: list[SeqStep]) -> ModelInput:
        """Positions, slots and block tables for the flat batch, built with tensor ops.

        For a sequence with c cached tokens and q new ones, new token i sits at position
        c + i and is written to slot ``block_table[pos // B] * B + pos % B``.
        """
        device, block_size = self.device, self.cache.shape.block_size
        query_lens = torch.tensor([len(s.new_token_ids) for s in seqs])
        computed = torch.tensor([s.num_computed_tokens for s in seqs])
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = torch.tensor(
            [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs],
            dtype=torch.int32,
        )
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), query_lens)
        starts = torch.cumsum(query_lens, 0) - query_lens
        positions = computed[seq_index] + torch.arange(int(query_lens.sum())) - starts[seq_index]
        blocks = tables[seq_index, positions // block_size].long()
        slots = blocks * block_size + positions % block_size
        context_lens = (computed + query_lens).to(torch.int32)
        num_prefill = int((query_lens > 1).sum())
        num_prefill_tokens = int(query_lens[:num_prefill].sum())
        start_loc = torch.zeros(num_prefill + 1, dtype=torch.int32)
        start_loc[1:] = torch.cumsum(query_lens[:num_prefill], 0)
        input_ids = list(itertools.chain.from_iterable(s.new_token_ids for s in seqs))
        meta = AttentionMetadata(
            slot_mapping=slots.to(device),
            num_prefill_tokens=num_prefill_tokens,
            prefill_query_start_loc=start_loc.to(device),
            prefill_context_lens=context_lens[:num_prefill].to(device),
            prefill_block_tables=tables[:num_prefill].to(device),
            decode_context_lens=context_lens[num_prefill:].to(device),
            decode_block_tables=tables[num_prefill:].to(device),
        )
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=positions.to(device),
            last_token_index=(starts + query_lens - 1).to(device),
            meta=meta,
        )
