"""Triton kernels, each a replacement for one named plain op (speedrun/ops.py) with its signature.

REPLACES maps an op name to the replacement's dotted path; the modules import Triton, so they are
imported only when a run installs them (speedrun/perf/swaps.py) or a test asks.
"""

REPLACES: dict[str, str] = {
    "gram": "speedrun.perf.kernels.gram.gram",
    "ba_plus_caa": "speedrun.perf.kernels.gram.ba_plus_caa",
    "softcapped_ce": "speedrun.perf.kernels.softcapped_ce.softcapped_ce",
    "softcapped_prefix_ce": "speedrun.perf.kernels.softcapped_ce.softcapped_prefix_ce",
    "sampled_softcapped_ce": "speedrun.perf.kernels.softcapped_ce.sampled_softcapped_ce",
    "ngram_embed": "speedrun.perf.kernels.ngram_embed.ngram_embed",
    "row_adam_rows": "speedrun.perf.kernels.row_adam.row_adam_rows",
    "relu2_linear": "speedrun.perf.kernels.relu2_linear.relu2_linear",
}
