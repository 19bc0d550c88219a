from deepmerge.layers import DELETE, merge

__all__ = ["DELETE", "merge"]
