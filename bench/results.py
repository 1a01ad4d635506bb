"""Where the GPU benchmarks leave their results: JSON files under $OUT (the device tool brings them back)."""
import json
import os


def write_json(name, payload):
    """``payload`` as $OUT/``name``; nothing when $OUT is not set (a run by hand prints its table only)."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump(payload, f, indent=1)
