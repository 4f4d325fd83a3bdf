"""The balanced binary tree of a mixture's sources, and a row's walk down it to its source.

`mixing` splits the sources [0, K) at `mid = (lo + hi) // 2`, recursively; each internal node
gives its left half `left(count)` of the rows it has received (a rounded running target). The
source of lane position p is the leaf whose count grows from p to p + 1. Counting every
source (`Mixture.counts`) evaluates all K - 1 nodes; the one source of a row is found by
evaluating only the nodes on its path, about log2(K): at a node that has received c rows
before p (so c + 1 before p + 1), the row goes left when the left half's count grows,
`left(c + 1) > left(c)`, and the child has received `left(c)` rows before p (`c - left(c)` on
the right). The numbers are those `counts` computes, node by node, so the sources and counts
are the same, bit for bit; a step's cost is its rows times the depth, whatever the number of
sources.

So that every row walks the same number of levels (one vectorised pass a level, nothing to
set aside), a leaf above the deepest level hangs below a chain of pass-through nodes: both
children the leaf, and parameters that make `left` 0 (every row goes right and keeps its
count), which both `mixing` formulas give for all-zero parameters.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from functools import lru_cache

import numpy as np

# (nodes, the rows' keys before, after, their counts c) -> (left(c), left(c + 1)) of each, new
# arrays (`descend` reuses the first)
LeftPair = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, ...]]


class Tree:
    """The tree over `count` sources, every leaf at depth `depth`. Node i (0 the root) splits
    sources [lo[i], hi[i]) at mid[i]; `split[i]` is its index among the real splits in the
    order `mixing` builds them (pre-order: a node, its left subtree, its right), -1 for a
    pass-through node (lo = mid = hi = 0); `children[i]` are its left and right child, a node
    index, or `-1 - source` for a leaf."""

    def __init__(self, count: int) -> None:
        self.depth = (count - 1).bit_length()  # of the deepest leaf of the balanced splits
        # flat lists (lo, mid, hi, split and left, right of each node), made arrays in one
        # call each: numpy's conversion of a list of small lists cost most of the build
        nodes: list[int] = []
        children: list[int] = []
        splits = 0

        def node(lo: int, mid: int, hi: int, split: int) -> int:
            nodes.extend((lo, mid, hi, split))
            children.extend((0, 0))
            return len(children) // 2 - 1

        def build(lo: int, hi: int, level: int) -> int:
            nonlocal splits
            if hi - lo == 1:
                if level == self.depth:
                    return -1 - lo
                index = node(0, 0, 0, -1)  # pass-through
                below = build(lo, hi, level + 1)
                children[2 * index : 2 * index + 2] = below, below
                return index
            mid = (lo + hi) // 2
            index = node(lo, mid, hi, splits)
            splits += 1
            children[2 * index : 2 * index + 2] = (
                build(lo, mid, level + 1),
                build(mid, hi, level + 1),
            )
            return index

        build(0, count, 0)
        table = _int64(nodes).reshape(-1, 4)
        self.lo, self.mid, self.hi, self.split = table.T
        self.children = _int64(children)  # [2 * node + right]
        self.doubled = 2 * self.children  # the same, each child's own index doubled
        for values in (table, self.children, self.doubled):  # shared: `tree`
            values.flags.writeable = False


@lru_cache(maxsize=8)
def tree(count: int) -> Tree:
    """The tree over `count` sources, made once per process for the last few counts: a feed
    lays its mixture out at its start and again at a restore's `adopt` or a `set_mix` (~1 ms
    of Python at 1,024 sources)."""
    return Tree(count)


def _int64(values: list[int]) -> np.ndarray:
    """`values` as an int64 array, by way of `array.array` (~5x cheaper than `np.array` of a
    list of Python ints: a tree of 256 sources has ~500 nodes)."""
    return np.frombuffer(array.array("q", values), np.int64)


# Counts below this are exact in float64 (`descend_constant` keeps them as floats).
EXACT = 1 << 53


def descend(
    tree: Tree, left_pair: LeftPair, received: np.ndarray, before: np.ndarray, after: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(source, that source's count before the row) of rows whose root has received `received`
    rows before them: `left_pair(nodes, before, after, c)` gives each row's node's left count
    after c rows (under the row's key `before`) and after c + 1 (under `after`)."""
    node = np.zeros(received.shape, np.int64)
    count = received.astype(np.int64)
    for _ in range(tree.depth):
        left, left_after = left_pair(node, before, after, count)
        right = left_after <= left  # the row goes right when the left count does not grow
        count = np.subtract(count, left, out=left, where=right)  # left's own count stays
        node = tree.children[2 * node + right]
    return -1 - node if tree.depth else node, count


def descend_constant(
    tree: Tree, omega: np.ndarray, received: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`descend` under constant weights (`omega[2 * node]`: the node's left share, its left
    count after c rows floor(omega * c + 1/2)), for `received` below `EXACT`. A step walks its
    rows down every level of the tree, so a level's numpy calls are most of what a big
    mixture's draw costs: the counts before and after the row are kept as one [2, rows] float
    array (c and c + 1, exact below 2^53, so `omega * c` is the same product, bit for bit),
    and the node as twice its index, to step to its child with one add and one gather."""
    counts = np.empty((2, received.size))
    counts[0] = received
    counts[1] = counts[0] + 1
    node2 = np.zeros(received.shape, np.int64)  # 2 * node
    left = np.empty_like(counts)
    for _ in range(tree.depth):
        np.multiply(counts, omega.take(node2), out=left)
        left += 0.5
        np.floor(left, out=left)
        right = left[1] <= left[0]  # the row goes right when the left count does not grow
        np.subtract(counts[0], left[0], out=left[0], where=right)  # left's own count stays
        np.add(left[0], 1, out=left[1])
        counts, left = left, counts
        node2 = tree.doubled.take(node2 + right)
    node = node2 >> 1
    return -1 - node if tree.depth else node, counts[0].astype(np.int64)
