"""Scoring captions and the statistics of a verdict: metrics, caption health, the paired bootstrap and win rates,
slices, regression alerts, the evaluate stage, captions made elsewhere."""
