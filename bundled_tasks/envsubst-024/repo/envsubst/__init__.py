from envsubst.template import UndefinedVariable, expand

__all__ = ["UndefinedVariable", "expand"]
