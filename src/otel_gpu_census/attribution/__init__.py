"""Attribution: who owes which part of the census.

- ``shares``: integer activity (:class:`Share`) and the exact largest-remainder split;
- ``windows``: by time window — a request's share of the 20 ms buckets it was in flight for;
- ``steps``: by engine step — a request's share of every step that served it, by scheduled tokens or
  (``cost_model``) by its estimated FLOPs in the step;
- ``ledger``: the requests of one server, the wait until the census is complete for each, and its
  :class:`~otel_gpu_census.attribution.ledger.GpuCost`.

Imports run one way: this package reads ``census`` and nothing above it.
"""
from otel_gpu_census.attribution.shares import NOTHING, Share, split_integer, split_weights
from otel_gpu_census.attribution.windows import METHOD, UNATTRIBUTED, Attribution, Interval, attribute, bucket_fractions, bucket_weights

__all__ = ["NOTHING", "Share", "split_integer", "split_weights", "METHOD", "UNATTRIBUTED", "Attribution",
           "Interval", "attribute", "bucket_fractions", "bucket_weights"]
