"""What a follower (a problem differing from its lead in the epilogue alone) measures whatever
its lead's shortlist: every candidate of the backends no cost model ranks (cuBLAS, the padded
path, and cuBLASLt, whose heuristic answers each epilogue with algorithms of its own)."""

import dataclasses

from gemmtune.tuning import tuner


def measured_whole(problem, device) -> set[str]:
    """The tuner's own spaces under an empty shortlist: the ranked backends keep nothing of it."""
    spaces = tuner._spaces(problem, device, dataclasses.replace(tuner.TuneOptions(), shortlist=()))
    return tuner.labels([(name, config.as_dict()) for name, configs in spaces.items() for config in configs])
