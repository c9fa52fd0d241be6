"""The pass/fail ledger the GPU check scripts print at the end."""
from __future__ import annotations

rows: list[tuple[str, str, bool]] = []


def check(name: str, detail: str, ok: bool) -> None:
    rows.append((name, detail, ok))
    print(("PASS " if ok else "FAIL ") + name + ": " + detail, flush=True)
