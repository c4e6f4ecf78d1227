"""How a batch's rows are cut into data-parallel shares and micro-batches: fixed sizes, or verl's token budgets
(`use_dynamic_bsz`, rows balanced by tokens, longest first). Every rank computes the same plan from the same
lengths, so no communication is needed to agree on it (docs/trainer.md).
"""
from __future__ import annotations

import heapq

import torch

Plan = list[list[torch.Tensor]]


def fixed_plan(rows: int, dp_size: int, micro_batch_size: int) -> Plan:
    """Contiguous equal blocks per rank cut into `micro_batch_size` rows; `rows` must divide by DP x micro size."""
    if rows % (dp_size * micro_batch_size):
        raise ValueError(f"{rows} rows do not fill {dp_size} ranks x {micro_batch_size} rows; pad them first")
    per_rank = rows // dp_size
    return [list(torch.arange(rank * per_rank, (rank + 1) * per_rank).split(micro_batch_size))
            for rank in range(dp_size)]


def balance_rows(lengths: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Row indices split into `parts` groups with near-equal token totals (longest row first to the lightest group).

    Every group gets at least one row when there are at least `parts` rows; each group's indices are ascending.
    """
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    values = lengths.tolist()
    heap = [(0, 0, part) for part in range(parts)]  # (tokens, rows, part): ties go to the group with fewer rows
    groups: list[list[int]] = [[] for _ in range(parts)]
    for row in order:
        tokens, count, part = heapq.heappop(heap)
        groups[part].append(row)
        heapq.heappush(heap, (tokens + values[row], count + 1, part))
    return [torch.tensor(sorted(group), dtype=torch.long) for group in groups]


def token_budget_micro_batches(lengths: torch.Tensor, rows: torch.Tensor, budget: int, budget_name: str,
                               min_count: int = 1, packed: bool = False) -> list[torch.Tensor]:
    """Cut `rows` into micro-batches with `len(micro) * longest row in it <= budget`, longest rows first; with
    `packed` (padding-free rows) the budget counts real tokens: the sum of the rows' lengths.

    `min_count` (the pipeline depth) splits the largest micro-batches further until there are that many, when the rows
    allow, so every pipeline stage has work. A row longer than the budget is an error naming both numbers.
    """
    row_lengths = lengths[rows]
    longest = int(row_lengths.max())
    if longest > budget:
        raise ValueError(f"a sequence of {longest} tokens (prompt + response) does not fit the token budget "
                         f"{budget_name}={budget}; raise {budget_name} to at least {longest} (e.g. "
                         f"data.max_prompt_length + data.max_response_length)")
    order = rows[torch.argsort(row_lengths, descending=True, stable=True)].tolist()
    values = lengths.tolist()
    batches: list[list[int]] = []
    used = 0
    for row in order:  # sorted longest first, so a micro-batch's first row is its longest
        cost = used + values[row] if packed else (len(batches[-1]) + 1) * values[batches[-1][0]] if batches else 0
        if batches and cost <= budget:
            batches[-1].append(row)
            used = cost
        else:
            batches.append([row])
            used = values[row]
    while len(batches) < min_count and max(len(b) for b in batches) > 1:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]) * values[batches[i][0]])
        if len(batches[largest]) == 1:
            largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        batch = batches.pop(largest)
        half = len(batch) // 2
        batches[largest:largest] = [batch[:half], batch[half:]]
    return [torch.tensor(batch, dtype=torch.long) for batch in batches]


def token_budget_plan(lengths: torch.Tensor, dp_size: int, budget: int, budget_name: str,
                      pipeline_stages: int = 1, packed: bool = False) -> Plan:
    """Rows balanced by tokens over the DP ranks, each rank's share cut by the token budget (needs rows >= DP)."""
    if lengths.numel() < dp_size:
        raise ValueError(f"{lengths.numel()} rows cannot be shared by {dp_size} data-parallel ranks; pad them first")
    return [token_budget_micro_batches(lengths, share, budget, budget_name, pipeline_stages, packed)
            for share in balance_rows(lengths, dp_size)]
