"""Analysis of a results table: correlations of measures with the gap, reports and plots."""

from .correlation import (
    CorrelationReport,
    MeasureCorrelation,
    ResultsTable,
    conditional_mi,
    correlate_table,
    granulated_kendall,
    jiang_tau,
    load_results,
)

__all__ = [
    "CorrelationReport",
    "MeasureCorrelation",
    "ResultsTable",
    "conditional_mi",
    "correlate_table",
    "granulated_kendall",
    "jiang_tau",
    "load_results",
]
