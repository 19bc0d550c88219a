from wordwrap.core import fill, wrap

__all__ = ["fill", "wrap"]
