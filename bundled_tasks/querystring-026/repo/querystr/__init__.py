from querystr.query import build_query, parse_query

__all__ = ["build_query", "parse_query"]
