from casing.convert import to_camel, to_kebab, to_snake, words

__all__ = ["to_camel", "to_kebab", "to_snake", "words"]
