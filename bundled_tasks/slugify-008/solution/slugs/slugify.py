"""URL slugs from arbitrary titles."""
import re
import unicodedata
from collections.abc import Container


def slugify(text: str, sep: str = "-", max_length: int | None = None) -> str:
    """Lower-case ASCII words of *text* joined by *sep*.

    Accented letters are reduced to their base letter ("é" -> "e"); other
    characters that have no ASCII form are dropped. With *max_length* the
    slug is cut at a word boundary so it is never longer than that.
    """
    # NFKD splits "é" into "e" + a combining accent (which the ASCII encode
    # drops) and maps compatibility forms such as ligatures to plain letters.
    normalized = unicodedata.normalize("NFKD", text)
    ascii_text = normalized.encode("ascii", "ignore").decode("ascii")
    words = re.findall(r"[a-z0-9]+", ascii_text.lower())
    slug = sep.join(words)
    if max_length is not None and len(slug) > max_length:
        cut = slug[: max_length + 1]
        slug = cut.rsplit(sep, 1)[0] if sep in cut else slug[:max_length]
    return slug


def unique_slug(text: str, taken: Container[str], sep: str = "-") -> str:
    """slugify(text), with a numeric suffix if that slug is already taken."""
    base = slugify(text, sep)
    slug, n = base, 2
    while slug in taken:
        slug = f"{base}{sep}{n}"
        n += 1
    return slug
