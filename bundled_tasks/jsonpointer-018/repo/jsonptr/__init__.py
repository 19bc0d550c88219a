from jsonptr.pointer import PointerError, make_pointer, resolve, split_pointer

__all__ = ["PointerError", "make_pointer", "resolve", "split_pointer"]
