"""Server-sent events out of an engine's byte stream, whatever the chunking.

An engine's chunks are TCP reads: an event may come in pieces, or several in one read. ``Events`` keeps
the unfinished tail and hands out whole events, each as its event name (``""`` for a plain one) and its
``data`` (lines joined by ``\\n``). Lines end with LF or CRLF (the SSE grammar allows both; vLLM writes
LF); comment lines (``:``) are dropped.
"""

from __future__ import annotations

DONE = b"[DONE]"


class Events:
    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[tuple[str, bytes]]:
        """The events completed by ``chunk``."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        out: list[tuple[str, bytes]] = []
        start = 0
        while (end := buf.find(b"\n\n", start)) >= 0:
            if buf.startswith(b"data: ", start) and buf.find(b"\n", start, end) < 0:
                out.append(("", buf[start + 6 : end]))  # one data line: what engines write
                start = end + 2
                continue
            block = buf[start:end]
            start = end + 2
            name = ""
            data: list[bytes] = []
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    data.append(line[6:] if line[5:6] == b" " else line[5:])
                elif line.startswith(b"event:"):
                    name = line[6:].strip().decode("latin-1")
            if data or name:
                out.append((name, b"\n".join(data)))
        self._buf = buf[start:]
        return out

    @property
    def pending(self) -> bool:
        """Bytes of an event not finished yet (a stream that ends here was cut)."""
        return bool(self._buf.strip())
