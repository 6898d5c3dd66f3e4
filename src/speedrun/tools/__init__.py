"""The researcher's tools around training: sample, evaluate, compare runs, benchmark."""
