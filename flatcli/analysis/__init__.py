"""Analysis of a results table: correlations of measures with the gap, reports and plots.

`table` reads and filters results tables, `statistics` holds the statistics (τ, Ψ, CMI,
bootstrap), `correlation` builds the report of every measure against the gap, `compare`
the paired comparisons of measures, `report` and `plots` render them."""

from .compare import compare_measures, zou_interval
from .correlation import CorrelationReport, MeasureCorrelation, correlate_table
from .statistics import bootstrap_intervals, conditional_mi, granulated_kendall, jiang_tau
from .table import ResultsTable, as_table, filter_rows, load_results

__all__ = [
    "CorrelationReport",
    "MeasureCorrelation",
    "ResultsTable",
    "as_table",
    "bootstrap_intervals",
    "compare_measures",
    "conditional_mi",
    "correlate_table",
    "filter_rows",
    "granulated_kendall",
    "jiang_tau",
    "load_results",
    "zou_interval",
]
