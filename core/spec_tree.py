"""The shape of a static draft tree (EAGLE-2 style speculation, `speculative_tree`).

A tree is given by its widths: each node at depth d has `widths[d]` children (the head's top
candidates after it), depths past the widths given one child (a chain). Nodes are numbered in
breadth-first order, node 0 the token fed (the tree's root) and each node's children in the
order of the head's ranking; a tree cut at a smaller depth is a prefix of it, so requests of
different draft depths share one numbering. The core counts its nodes (KV slots a step
writes); the executor drafts, verifies and accepts over it (executors/spec/tree.py).
"""

from __future__ import annotations

from functools import cache

MAX_TREE_NODES = 64  # draft nodes of the deepest tree, at most: a verify step's rows a request


@cache
def tree_parents(widths: tuple[int, ...], depth: int) -> tuple[int, ...]:
    """Each node's parent, node 0 (the root) first with -1: the tree of `widths` cut at
    `depth` draft positions."""
    parents, frontier = [-1], [0]
    for d in range(depth):
        width = widths[d] if d < len(widths) else 1
        grown = []
        for node in frontier:
            for _ in range(width):
                grown.append(len(parents))
                parents.append(node)
        frontier = grown
    return tuple(parents)


def tree_size(widths: tuple[int, ...], depth: int) -> int:
    """Draft nodes of the tree cut at `depth` (the root not counted)."""
    return len(tree_parents(widths, depth)) - 1


def tree_depths(parents: tuple[int, ...]) -> list[int]:
    """Each node's depth, the root's 0."""
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return depths


def tree_path(parents: tuple[int, ...], node: int) -> list[int]:
    """The nodes from the root's first child down to `node` (empty for the root)."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
