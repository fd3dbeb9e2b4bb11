"""A tool's JSON as figures: its tables (lists of records) and its scalars, found wherever they sit."""

from __future__ import annotations

# Fields that name a row rather than measure it, in the order a row's label takes them
ROW_KEYS = ("label", "name", "op", "mode", "kind", "fmt", "shape", "batch", "concurrency", "users", "rows",
            "tokens", "budget", "prompt", "length")


def is_scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def flat_scalars(d: dict, prefix: str = "") -> dict:
    """A dict's scalar leaves under dotted keys, through nested dicts (not lists)."""
    out = {}
    for k, v in d.items():
        if is_scalar(v):
            out[prefix + str(k)] = v
        elif isinstance(v, dict):
            out |= flat_scalars(v, f"{prefix}{k}.")
    return out


def tables(obj, path: str = "") -> list[tuple[str, list[dict]]]:
    """Every list of records in obj, each as (path, rows of flat scalars)."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += tables(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        if obj and all(isinstance(x, dict) for x in obj):
            found.append((path, [flat_scalars(x) for x in obj]))
            for i, x in enumerate(obj):
                found += [(p, rows) for p, rows in tables(x, f"{path}[{i}]") if rows]
    return [(p, rows) for p, rows in found if any(rows)]


def row_label(row: dict, index: int) -> str:
    parts = [f"{k}={row[k]}" for k in ROW_KEYS if k in row and row[k] not in (None, "")]
    return ",".join(parts[:3]) or f"#{index}"


SKIP = {"meta", "argv", "engine_args", "config"}  # what a run was told, not what it measured


def numbers(obj, path: str = "") -> dict[str, float]:
    """Every number in obj under a path that names list rows by their labels, to compare two runs."""
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return {path: float(obj)}
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k not in SKIP:
                out |= numbers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, x in enumerate(obj):
            if isinstance(x, dict):
                x = {k: v for k, v in x.items() if k not in ROW_KEYS} | {"__label": row_label(flat_scalars(x), i)}
                out |= numbers({k: v for k, v in x.items() if k != "__label"}, f"{path}[{x['__label']}]")
            else:
                out |= numbers(x, f"{path}[{i}]")
    return out
