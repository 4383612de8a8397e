"""DeepEP V2's expanding layout over ferry's token-major dispatch: each received token's copy
for each of this rank's experts in its own row, grouped by expert, each expert's rows rounded up
to expert_alignment (what a contiguous grouped GEMM reads), and the fold back to one row per
token before the combine. Device torch ops in a fixed order, so the results are deterministic;
none waits for the host."""

import torch


def expanded_rows(rows, k, local, alignment):
    """Rows an expanded dispatch of `rows` received tokens may fill: every token's copies to
    all of its experts here (at most min(k, local) each), each expert's block rounded up."""
    worst = rows * min(k, local) + local * (alignment - 1)
    return (worst + alignment - 1) // alignment * alignment


def expert_slots(experts, local, alignment):
    """(slots [rows, k] int64: the expanded row of each token's copy, -1 where the copy is not
    ours; counts [local] int64: copies per expert; starts [local] int64: each expert's first
    row). experts: [rows, k] local expert ids or -1 (rows that received nothing hold -1 only).
    An expert's copies keep the order of their tokens, then of their columns."""
    rows, k = experts.shape
    dev = experts.device
    flat = experts.reshape(-1).long()
    ours = flat >= 0
    key = torch.where(ours, flat, local)
    # Counted from the ids themselves, so the slots cannot disagree with them.
    counts = torch.bincount(key, minlength=local + 1)[:local]
    aligned = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(aligned, 0) - aligned
    firsts = torch.cumsum(counts, 0) - counts  # each expert's first place among sorted copies
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    tail = torch.zeros(1, dtype=torch.int64, device=dev)
    place = (torch.cat([starts, tail])[sorted_key] + torch.arange(flat.numel(), device=dev) -
             torch.cat([firsts, tail])[sorted_key])
    slots = torch.empty_like(flat).scatter_(0, order, place)
    return torch.where(ours, slots, -1).view(rows, k), counts, starts


def expand(rows_in, slots, total, zero):
    """rows_in [rows, ...] laid out as slots say: [total, ...] with row slots[t, j] a copy of
    row t. Rows no copy fills are zero with `zero`, else unwritten."""
    rows, k = slots.shape
    # One-byte rows (fp8) are copied as bytes: torch's CUDA index_copy_ has no fp8 kernel.
    src = rows_in.view(torch.uint8) if rows_in.element_size() == 1 else rows_in
    out = (torch.zeros if zero else torch.empty)((total + 1,) + tuple(src.shape[1:]),
                                                 dtype=src.dtype, device=src.device)
    # A copy that is not ours goes to the extra last row, dropped after.
    dst = torch.where(slots >= 0, slots, total)
    for j in range(k):
        out.index_copy_(0, dst[:, j], src)
    return out[:total].view(rows_in.dtype)


def expand_weights(weights, slots, total):
    """weights [rows, k] fp32 at their copies' expanded rows: [total], 0 where no copy is."""
    out = torch.zeros(total + 1, dtype=weights.dtype, device=weights.device)
    dst = torch.where(slots >= 0, slots, total)
    for j in range(slots.shape[1]):
        out.index_copy_(0, dst[:, j], weights[:, j])
    return out[:total]


def fold(x, slots):
    """An expanded combine's input [total, hidden] back to one row per token [rows, hidden]:
    the sum of its copies' rows in fp32 (column by column, so the order is fixed), rounded to
    x's dtype once."""
    rows, k = slots.shape
    safe = slots.clamp(min=0)
    ours = (slots >= 0).unsqueeze(2)
    acc = torch.zeros(rows, x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):
        acc += torch.where(ours[:, j], x.index_select(0, safe[:, j]).float(), 0.0)
    return acc.to(x.dtype)


def fold_weights(weights, slots):
    """An expanded combine's top-k weights [total] back to [rows, k] (0 where not ours)."""
    return torch.where(slots >= 0, weights[slots.clamp(min=0)], 0.0)


def tma_aligned_scales(scales):
    """scales [rows, groups] fp32 in the TMA-aligned column-major layout (DeepGEMM's): the
    same values, each column contiguous and its rows padded to 16 bytes."""
    rows, groups = scales.shape
    padded = (rows + 3) // 4 * 4
    out = torch.empty(groups, padded, dtype=scales.dtype, device=scales.device)
    out[:, :rows].copy_(scales.t())
    return out[:, :rows].t()
