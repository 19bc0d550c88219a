from safepath.join import UnsafePath, resolve_url_path, safe_join

__all__ = ["UnsafePath", "resolve_url_path", "safe_join"]
