"""The front door's defences, driven by one policy table (`policy.py`): token buckets
(`buckets.py`) and the rates routes take from them (`rates.py`), metered reads and heavy-read
turns (`reads.py`), held refusals (`holds.py`), telemetry decode budgets (`budgets.py`), and the
admin UI's sign-in defences (`password_checks.py`, `signin_throttle.py`, `signin_gate.py`).
`route_guard.py` wires them onto the API."""
