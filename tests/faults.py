"""What the fault tests do to a checkpoint's files, written once: flip bytes, a pickle that
would run code."""

from pathlib import Path


def flip(path: Path, count: int = 64) -> None:
    """Invert `count` bytes in the middle of the file (the size stays)."""
    data = bytearray(Path(path).read_bytes())
    mid = len(data) // 2
    data[mid : mid + count] = bytes(b ^ 0xFF for b in data[mid : mid + count])
    Path(path).write_bytes(bytes(data))


class Payload:
    """Unpickling calls `open(path, "w")`: the file appears only if the pickle ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
