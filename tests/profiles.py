"""Reading a pprof `Profile` (as decoded by the `profile_pb2` fixture) in tests."""

from __future__ import annotations

from typing import Any


def functions_in(profile: Any) -> dict[str, int]:
    """Function name -> the first value (samples or objects) of the samples whose stack holds it."""
    names = {f.id: profile.string_table[f.name] for f in profile.function}
    by_location = {loc.id: [names[line.function_id] for line in loc.line] for loc in profile.location}
    out: dict[str, int] = {}
    for sample in profile.sample:
        for fn in {n for loc in sample.location_id for n in by_location[loc]}:
            out[fn] = out.get(fn, 0) + sample.value[0]
    return out
