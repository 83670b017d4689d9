"""The order in which gemmtune's kernels visit output tiles."""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile, grid_m, grid_n, GROUP_M: tl.constexpr):
    """(row, column) of output tile number ``tile`` of a grid_m x grid_n grid visited in groups of
    GROUP_M tile rows, column by column within a group: neighbouring programs share B's tiles in
    L2 while they last, where a row-by-row order would stream all of B once per tile row."""
    per_group = GROUP_M * grid_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = min(grid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows
