from pctl.stats import percentile, summary

__all__ = ["percentile", "summary"]
