from buildorder.graph import CycleError, layers, topo_order

__all__ = ["CycleError", "layers", "topo_order"]
