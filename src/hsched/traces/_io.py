"""Small file helpers shared by the trace loaders."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from hsched.domain.errors import ValidationError


class TraceFileError(ValidationError):
    """A trace file that cannot be read, or one of its records that breaks a rule: the message starts with the file
    (`file:line` when a line is at fault), then the field and the rule."""

    def __init__(self, file: str | Path, rule: str, line: int | None = None, field: str = "",
                 value: object = None) -> None:
        where = f"{file}:{line}" if line is not None else str(file)
        super().__init__(f"{where}: {field}" if field else where, rule, value)
        self.file = str(file)


def open_text(path: str | Path) -> TextIO:
    """Open a text file for reading, transparently decompressing `*.gz`."""
    p = Path(path)
    if p.suffix == ".gz":
        return gzip.open(p, "rt", encoding="utf-8", newline="")
    return p.open("r", encoding="utf-8", newline="")


def text_lines(path: str | Path) -> Iterator[str]:
    """The lines of a UTF-8 text file (`*.gz` decompressed), line ends kept, read as they are iterated; TraceFileError
    naming the file when it cannot be read: missing, not gzip, truncated, or not UTF-8 text (with the line)."""
    p = Path(path)
    offset = 0
    try:
        with gzip.open(p) if p.suffix == ".gz" else p.open("rb") as fh:
            for line, raw in enumerate(fh, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceFileError(p, f"is not UTF-8 text (byte {offset + exc.start})", line) from None
                offset += len(raw)
                yield text
    except EOFError:
        raise TraceFileError(p, "is truncated: the gzip stream ends before its end-of-stream marker") from None
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise TraceFileError(p, f"is not a valid gzip file ({exc})") from None
    except OSError as exc:
        raise TraceFileError(p, f"cannot be read ({exc.strerror or exc})") from None
