"""The fifth round's trials other than resume (tests/trials_round5.py runs them)."""

GROUPS = []
