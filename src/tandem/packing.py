"""Bin packing shared by SFT and RL batching: samples into rows, rows onto ranks (one implementation)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= capacity, longest first into the first bin that fits."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        if length > capacity:
            raise ValueError(f"item {index} has length {length}, more than the capacity {capacity}")
        target = next((b for b, free in enumerate(room) if free >= length), None)
        if target is None:
            bins.append([])
            room.append(capacity)
            target = len(bins) - 1
        bins[target].append(index)
        room[target] -= length
    return bins


def balance(sizes: Sequence[int], groups: int) -> list[list[int]]:
    """Indices split into `groups` equal-count groups whose size totals are as even as greedy allows.

    Equal counts matter: every trainer rank must run the same number of micro-batches (FSDP
    collectives). Within that, the largest items go first to the group with the smallest total.
    """
    if len(sizes) % groups:
        raise ValueError(f"{len(sizes)} items cannot be split evenly over {groups} groups")
    per_group = len(sizes) // groups
    members: list[list[int]] = [[] for _ in range(groups)]
    heap = [(0, group) for group in range(groups)]
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        full = []
        total, group = heapq.heappop(heap)
        while len(members[group]) >= per_group:
            full.append((total, group))
            total, group = heapq.heappop(heap)
        members[group].append(index)
        heapq.heappush(heap, (total + sizes[index], group))
        for item in full:
            heapq.heappush(heap, item)
    return members
