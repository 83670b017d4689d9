"""What a follower (a problem differing from its lead in the epilogue alone) measures whatever
its lead's shortlist: every candidate of the backends no cost model ranks (cuBLAS, the padded
path, and cuBLASLt, whose heuristic answers each epilogue with algorithms of its own)."""

from gemmtune import backends
from gemmtune.tuning import tuner


def measured_whole(problem, device) -> set[str]:
    plan = []
    for name in backends.names():
        backend = backends.get(name)
        configs = backend.candidates(problem, device) if backend.is_available(device) else []
        if configs and backend.predict_ms(problem, device, configs[0]) is None:
            plan += [(name, config.as_dict()) for config in configs]
    return tuner.labels(plan)
