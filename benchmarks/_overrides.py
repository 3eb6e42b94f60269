"""``--set KEY=VALUE`` for the Adapt SAM benchmarks: a training schedule's fields overridden
from the command line."""


def override(cfg, items):
    """``cfg`` with each ``KEY=VALUE`` of ``items`` set, as the field's type (``None`` clears
    it; a tuple field takes its numbers separated by ``;``, e.g. ``view_zooms=1;1.5``)."""
    for item in items:
        key, value = item.split("=", 1)
        cur = getattr(cfg, key)
        if value == "None":
            setattr(cfg, key, None)
        elif cur is None and value.lstrip("-").isdigit():
            setattr(cfg, key, int(value))
        elif isinstance(cur, tuple):
            setattr(cfg, key, tuple(float(v) for v in value.split(";")))
        else:
            setattr(cfg, key, type(cur)(value))
    return cfg
