"""Human-readable byte counts with binary (IEC) units."""
import re

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)?\s*$", re.IGNORECASE)


def format_size(num_bytes: int, precision: int = 1) -> str:
    """Format *num_bytes* with the largest unit that keeps the number below 1024.

    Byte counts are shown as integers ("512 B"); larger units use
    *precision* decimals ("1.5 KiB").
    """
    if num_bytes < 0:
        return "-" + format_size(-num_bytes, precision)
    value = float(num_bytes)
    unit = UNITS[0]
    for unit in UNITS:
        # Compare what will be printed: 1023.96 KiB must show as 1.0 MiB, not 1024.0 KiB.
        if round(value, precision) < 1024 or unit == UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{num_bytes} B"
    return f"{value:.{precision}f} {unit}"


def parse_size(text: str) -> int:
    """Inverse of format_size: "1.5 KiB" -> 1536. A missing unit means bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r}")
    number, unit = match.groups()
    unit = (unit or "B").upper().replace("IB", "iB")
    if unit != "B" and not unit.endswith("iB"):
        unit = unit[0] + "iB"
    return round(float(number) * 1024 ** UNITS.index(unit))
