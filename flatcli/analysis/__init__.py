"""Analysis of a results table: correlations of measures with the gap, reports and plots."""

from .compare import compare_measures, zou_interval
from .correlation import (
    CorrelationReport,
    MeasureCorrelation,
    ResultsTable,
    as_table,
    bootstrap_intervals,
    conditional_mi,
    correlate_table,
    filter_rows,
    granulated_kendall,
    jiang_tau,
    load_results,
)

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
