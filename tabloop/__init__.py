"""The top floor: the ``tabloop`` command, the supervisor that runs the whole system, and the benches that
time it end to end. It imports every area; no area imports it."""
