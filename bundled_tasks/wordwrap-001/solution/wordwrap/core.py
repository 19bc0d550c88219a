"""Greedy word wrapping for plain-text output."""


def _chunks(word: str, width: int) -> list[str]:
    return [word[i:i + width] for i in range(0, len(word), width)]


def wrap(text: str, width: int, break_long_words: bool = True) -> list[str]:
    """Split *text* into lines of at most *width* characters.

    Words are separated by any whitespace. A word longer than *width* is
    cut into pieces of *width* characters when *break_long_words* is true,
    otherwise it is kept whole on a line of its own.
    """
    if width < 1:
        raise ValueError("width must be at least 1")
    lines: list[str] = []
    current = ""
    for word in text.split():
        if len(word) > width:
            if current:
                lines.append(current)
            pieces = _chunks(word, width) if break_long_words else [word]
            lines.extend(pieces[:-1])
            current = pieces[-1]
            continue
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def fill(text: str, width: int, break_long_words: bool = True) -> str:
    """Like wrap() but joins the lines with newlines."""
    return "\n".join(wrap(text, width, break_long_words))
