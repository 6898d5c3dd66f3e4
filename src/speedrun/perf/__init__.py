"""The speed layer: code that only makes the algorithm faster, each piece beside the plain op it replaces.

Nothing in the algorithm (model/, optim/, train/'s step) imports it; reading for the algorithm can skip it.
`swaps.install` (called once where the run builds its model) swaps named plain ops (speedrun/ops.py) for
kernels where the device runs them and `train.perf` allows; `kernels/` holds the Triton kernels;
`compiled_updates`, `overlap` and `graphs` (with `capture_plan` and `optimizer_graphs`) swap the optimizer's
updates, its reductions and the step's launches, each installed by the loop's set-up in one line.
"""
