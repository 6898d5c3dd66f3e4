"""The step-cut control arm's arithmetic (`certify --step-cut 12,24`): the baseline trained with N fewer
steps prices loss in time on this machine. Each point is an arm's (mean training time, mean final val
loss): the baseline's and each cut arm's. Time in ms is fitted to loss in millinats by least squares
(through the two points when there is one cut); minus its slope is the exchange rate, ms per millinat
(#92 priced it at 164, a band of 120-250 from its own cuts). The iso-loss line asks whether the
candidate beats simply training fewer steps: the fitted line's time at the candidate's loss is what the
baseline would take to reach that loss, and the candidate beats it when it takes less."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Exchange:
    rate_ms_per_mnat: float  # ms of training time one millinat of val loss is worth (positive: normal)
    intercept_ms: float  # the fitted line: time_ms = intercept_ms - rate · loss_mnat
    per_cut: list[tuple[str, float | None]]  # (arm, its own rate against the baseline point)

    def time_at(self, loss: float) -> float:
        """Training time in seconds the baseline's line gives at val loss `loss` (nats)."""
        return (self.intercept_ms - self.rate_ms_per_mnat * loss * 1000) / 1000


def exchange_rate(baseline: tuple[float, float], cuts: dict[str, tuple[float, float]]) -> Exchange | None:
    """The exchange rate from (time s, loss nats) points; None when the losses do not vary (no slope)."""
    points = [baseline, *cuts.values()]
    ts = [t * 1000 for t, _ in points]
    vs = [v * 1000 for _, v in points]
    mt, mv = sum(ts) / len(ts), sum(vs) / len(vs)
    sxx = sum((v - mv) ** 2 for v in vs)
    if sxx == 0:
        return None
    slope = sum((v - mv) * (t - mt) for v, t in zip(vs, ts, strict=True)) / sxx
    per_cut = []
    for arm, (t, v) in cuts.items():
        dv = (v - baseline[1]) * 1000
        per_cut.append((arm, (baseline[0] - t) * 1000 / dv if dv else None))
    return Exchange(-slope, mt - slope * mv, per_cut)


def iso_loss(ex: Exchange, candidate: tuple[float, float]) -> tuple[float, float, bool]:
    """(the baseline line's time at the candidate's loss, the candidate's margin under it in seconds, and
    whether the candidate beats training fewer steps: it takes less time than that)."""
    at = ex.time_at(candidate[1])
    return at, at - candidate[0], candidate[0] < at
