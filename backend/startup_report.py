"""Why tritonserver did not start, read from its log: the real cause as the headline (the first
error Triton logged, a model's exception message unescaped), never the lines every CPU start
prints and that mean nothing (Triton probing for a GPU)."""

from __future__ import annotations

import re

# Printed by Triton on every start without a GPU (or without DCGM): harmless.
HARMLESS = (
    "Failed to initialize NVML",
    "CudaDriverHelper has not been initialized",
    "DCGM unable to start",
    "Unable to allocate pinned system memory",
    "CUDA memory pool disabled",
)
HARMLESS_NOTE = ("Triton probes for a GPU at every start: 'Failed to initialize NVML', 'CudaDriverHelper has not "
                 "been initialized', 'DCGM unable to start' and the pinned-memory warning are harmless on a host "
                 "without one.")
_TRITON_LINE = re.compile(r'^([EWI])\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] "?(.*?)"?$')
_TRACEBACK = "\n\nAt:\n"  # the python backend appends the stack after the message


def harmless(line: str) -> bool:
    return any(text in line for text in HARMLESS)


def unescape(message: str) -> str:
    """Triton logs a message as a JSON-ish string: \\n, \\" and \\\\ escaped."""
    return re.sub(r'\\(["\\n])', lambda m: "\n" if m.group(1) == "n" else m.group(1), message)


def headline(lines: list[str]) -> str | None:
    """The first error Triton logged that is not one of the harmless ones: a model's load error
    without its stack ("failed to load 'deepseek_v4' version 1: Internal: FileNotFoundError: ..."),
    a service that could not start, ...; else Triton's own last `error:` line; else None."""
    for line in lines:
        match = _TRITON_LINE.match(line.rstrip("\n"))
        if match and match.group(1) == "E" and not harmless(line):
            return unescape(match.group(2)).split(_TRACEBACK, 1)[0].removeprefix("ERROR: ").strip()
    for line in reversed(lines):
        if line.startswith("error:") and not harmless(line):
            return line.removeprefix("error:").strip()
    return None


def last_lines(lines: list[str], count: int = 25) -> list[str]:
    """The log's last lines without Triton's tables, blank lines and the harmless ones."""
    kept = [line.rstrip("\n") for line in lines
            if line.strip() and not line.startswith(("+-", "| ")) and not harmless(line)]
    return kept[-count:]
